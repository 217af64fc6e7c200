"""The manifest schema spells task, strategy and dtype as Literals (for its JSON Schema); deploykit.names
holds the same values as str Enums. They must not drift apart."""

from typing import get_args

from deploykit.artifacts.reshard import DTYPES
from deploykit.names import DType, Load, Quantization, Strategy, Task
from deploykit.spec.schema import Lifecycle, ModelSpec, Rollout


def test_manifest_literals_equal_the_enums():
    assert set(get_args(ModelSpec.model_fields["task"].annotation)) == {t.value for t in Task}
    assert set(get_args(ModelSpec.model_fields["dtype"].annotation)) == {d.value for d in DType}
    assert set(get_args(Rollout.model_fields["strategy"].annotation)) == {s.value for s in Strategy}
    assert set(get_args(ModelSpec.model_fields["quantization"].annotation)) == {q.value for q in Quantization}
    assert set(DTYPES) == {d.value for d in DType}
    assert set(get_args(Lifecycle.model_fields["load"].annotation)) == {m.value for m in Load}


def test_members_print_as_their_values():
    """A member goes wherever the plain string went (messages, JSON, the state store)."""
    import json

    from deploykit.control.live.rollout import choose_strategy
    from deploykit.names import Phase

    chosen = choose_strategy("auto", fits_beside=True)
    assert (f"{chosen}", str(chosen), "%s" % chosen, json.dumps(chosen)) == ("blue-green",) * 3 + ('"blue-green"',)
    assert f"{Phase.READY:>7}" == "  Ready" and Phase("Ready") == "Ready"
