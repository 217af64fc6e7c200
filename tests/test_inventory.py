import pytest

from deploykit.errors import InventoryError
from deploykit.placement.inventory import ENV_VAR, parse_devices, probe, resolve

GiB = 2**30


def test_uniform_gpus():
    inv = parse_devices("4x80GiB")
    assert [g.index for g in inv.gpus] == [0, 1, 2, 3]
    assert all(g.memory == 80 * GiB for g in inv.gpus)
    assert inv.simulated and inv.cpu is None and inv.disk is None


@pytest.mark.parametrize("spec", ["2x24GiB,1x48GiB", "2x24GiB+1x48GiB", "24GiB, 24GiB, 48GiB"])
def test_mixed_gpus_numbered_in_order(spec):
    inv = parse_devices(spec)
    assert [(g.index, g.memory // GiB) for g in inv.gpus] == [(0, 24), (1, 24), (2, 48)]


def test_cpu_and_disk_tiers():
    inv = parse_devices("1x16GiB,cpu=64GiB,disk=1TiB")
    assert len(inv.gpus) == 1 and inv.cpu == 64 * GiB and inv.disk == 2**40


@pytest.mark.parametrize("spec", ["none", ""])
def test_no_gpu(spec):
    assert parse_devices(spec).gpus == ()


@pytest.mark.parametrize("spec", ["4y80GiB", "4x", "0x80GiB", "4x80XB", "gpu=3GiB", "x80GiB",
                                  "\u0661x80GiB", "2x(4x80GiB\n)"])
def test_bad_specs_name_the_item(spec):
    with pytest.raises(InventoryError, match="cannot read device spec"):
        parse_devices(spec)


def test_env_var_is_used_when_no_flag(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "2x10GiB")
    assert len(resolve(None).gpus) == 2
    assert len(resolve("3x10GiB").gpus) == 3  # the flag wins


def test_probe_reads_this_host(tmp_path):
    inv = probe(disk_path=tmp_path / "not" / "yet")
    assert not inv.simulated
    assert inv.cpu is not None and inv.cpu > 0
    assert inv.disk is not None and inv.disk > 0
