"""The measured tables live in one generated module (lora_kernels/backends/tables.py); it must be exactly what
the generator writes for its own values, with the header naming the device, date and command."""

import pytest
import torch

from lora_kernels.backends import auto, tables, tables_io


def test_tables_module_is_what_the_generator_writes():
    text = tables_io.PATH.read_text()
    head = tables_io.header(text)
    assert set(head) == {"device", "date", "command"}
    assert head["command"].startswith(tables_io.COMMAND)
    assert tables_io.render(tables.TRITON_BLOCKS, tables.AUTO, head["device"], head["date"], head["command"]) == text


def test_generator_round_trip(tmp_path):
    blocks = {k: {**v} for k, v in tables.TRITON_BLOCKS.items()}
    blocks["expand"]["ctas_per_sm"] = 3
    blocks["tall"] = {"min_rows": 1024, "one_dot": True, "x": False}  # booleans must come back as Python's
    path = tmp_path / "tables.py"
    tables_io.write(blocks, dict(tables.AUTO), "NVIDIA H200", "2026-11-23", path)
    ns = {}
    exec(path.read_text(), ns)
    assert ns["TRITON_BLOCKS"] == blocks and ns["AUTO"] == tables.AUTO
    assert tables_io.header(path.read_text())["device"] == "NVIDIA H200"


def test_auto_table_names_every_regime_with_a_known_backend():
    from lora_kernels import backends

    assert set(tables.AUTO) == set(tables_io.REGIMES)
    assert set(tables.AUTO.values()) <= set(backends.NAMES)
    with pytest.raises(ValueError, match="auto table must name a backend"):
        tables_io.render(tables.TRITON_BLOCKS, {"decode": "triton"}, "x", "y")
    assert {auto.regime(type("I", (), dict(num_segments=1, num_tokens=64, max_seg_len=64))())} == {"one_segment"}


@pytest.mark.parametrize("segs, rows, longest, want", [
    (64, 64, 1, "decode"), (12, 64, 9, "mixed"), (32, 256, 256, "mixed"), (64, 1087, 1024, "chunked"),
    (2, 512, 511, "chunked"), (40, 511, 511, "mixed"), (8, 8192, 1024, "prefill"), (1, 2048, 2048, "one_segment")])
def test_regime_tells_a_chunked_step_from_a_sorted_decode_batch(segs, rows, longest, want):
    """Below 2048 rows, batches of 512 rows or more (a prefill chunk beside decode rows) are their own regime: the
    backend that wins them is not the one that wins sorted decode batches. longest is max_seg_len, the token capacity
    in graph mode (256 for a 256-row sorted decode batch there): rows decide, not it."""
    info = type("I", (), dict(num_segments=segs, num_tokens=rows, max_seg_len=longest))()
    assert auto.regime(info) == want


def test_auto_choice_is_memoized_per_table(monkeypatch):
    """auto.choose remembers its answer per (device, regime) and starts over when the table object is replaced
    (a regenerated or patched table takes effect at once)."""
    decode = type("I", (), dict(num_segments=4, num_tokens=4, max_seg_len=1))()
    dev = torch.device("cuda")  # a device object only: nothing here touches a GPU
    monkeypatch.setattr(tables, "AUTO", {**tables.AUTO, "decode": "torch"})
    assert auto.choose(dev, decode) == "torch"
    assert auto._memo[1][(dev, "decode")] == "torch"
    monkeypatch.setattr(tables, "AUTO", {**tables.AUTO, "decode": "torch", "mixed": "torch"})
    assert auto._memo[0] is not tables.AUTO
    assert auto.choose(dev, decode) == "torch" and auto._memo[0] is tables.AUTO
    assert auto.choose(torch.device("cpu"), decode) == "torch"
