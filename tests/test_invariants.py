"""The model-based test (docs/testing.md): hypothesis drives a real deploykit through random sequences of
manifest writes, control-API calls, traffic and faults on tiny real models, and checks its invariants after
every step; a failure prints its seed and the shrunk sequence. ``make test`` runs a few fixed sequences;
``make soak SEEDS=N`` runs N random ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import seed
from hypothesis.stateful import run_state_machine_as_test

from invariants.config import KNOWN_OPEN, Run, open_ops, run
from invariants.library import LibraryMachine
from invariants.server import ServerMachine
from invariants.source import SourceMachine
from invariants.world import Spec, World


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("world"))


def _run(machine: type, this: Run, label: str) -> None:
    if this.seed is not None:
        machine = seed(this.seed)(machine)
    where = f"seed {this.seed}" if this.seed is not None else "derandomized (fixed) seed"
    print(f"{label}: {this.examples} examples of {this.steps} steps, {where}; left out: "
          f"{sorted(open_ops()) or 'nothing'}", file=sys.stderr)
    try:
        run_state_machine_as_test(machine, settings=this.settings())
    except BaseException as exc:
        detail = f"{label} failed with {where} (DEPLOYKIT_SOAK_SEED={this.seed} replays it)" \
            if this.seed is not None else f"{label} failed with its {where}"
        raise AssertionError(f"{detail}; the shrunk sequence is printed above: {exc}") from exc


def test_library_deployment_keeps_its_invariants(world: World, tmp_path: Path) -> None:
    machine = type("Library", (LibraryMachine,), {"world": world, "root": tmp_path})
    _run(machine, run(examples=3, steps=10), "the library tier")


def test_deploykit_serve_keeps_its_invariants(world: World, tmp_path: Path) -> None:
    machine = type("Serve", (ServerMachine,), {"world": world, "root": tmp_path})
    _run(machine, run(examples=2, steps=8), "the serve tier")


def test_a_git_source_keeps_its_invariants(world: World, tmp_path: Path) -> None:
    machine = type("Source", (SourceMachine,), {"world": world, "root": tmp_path})
    _run(machine, run(examples=2, steps=8), "the git-source tier")


def test_known_open_entries_name_operations_the_generator_draws() -> None:
    """An entry of KNOWN_OPEN that matches no operation would leave nothing out: a typo, or a fix
    forgotten in the list."""
    from invariants.server import SERVER_OPS  # noqa: PLC0415
    from invariants.world import ADAPTERS, BASES, STRATEGIES

    drawn = ({f"base_{b}" for b in BASES} | {f"adapter_{a}" for a in ADAPTERS} | {f"strategy_{s}" for s in STRATEGIES}
             | {f"{s}_{b}" for s in STRATEGIES for b in BASES} | {"quant_int8", "schema_broken", "on_demand",
                                                                   "recreate_adapters", "shard_2GiB", "shard_300KiB"}
             | SERVER_OPS | {"restart_broken_file"})
    assert set(KNOWN_OPEN) <= drawn, sorted(set(KNOWN_OPEN) - drawn)


# The shortest sequences the generator found for each defect it found (docs/testing.md), replayed as they were
# shrunk: expected to fail while their operation is in KNOWN_OPEN (strict: a fix makes them pass, which fails
# until the entry is removed), and to pass for good after.
FOUND: dict[str, tuple[str, list[Spec]]] = {
    "K1 failed adapter load leaves the base answering with another adapter": (
        "adapter_rank", [Spec(adapters=(("pirate", "pirate"),)),
                         Spec(adapters=(("pirate", "pirate"), ("polite", "rank")))]),
    "K2 recreate with a failing build leaves nothing serving": (
        "adapter_rank", [Spec(strategy="recreate", adapters=(("pirate", "pirate"), ("polite", "rank")))]),
    "K3 pissa adapter rewrites the base": ("adapter_pissa", [Spec(adapters=(("pirate", "pissa"),))]),
}


@pytest.mark.parametrize("found", sorted(FOUND))
def test_sequences_the_generator_found(found: str, world: World, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    op, sequence = FOUND[found]
    if op in KNOWN_OPEN:
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError, reason=f"KNOWN_OPEN[{op!r}]: {KNOWN_OPEN[op]}"))
    machine = type("Library", (LibraryMachine,), {"world": world, "root": tmp_path})()
    try:
        machine.what_status_says_serves_answers()
        for spec in sequence:
            machine.write_and_reload(spec)
            machine.what_status_says_serves_answers()
            machine.nothing_outside_is_touched()
    finally:
        machine.teardown()
