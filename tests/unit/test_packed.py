"""The prepacked oneDNN linear kernel and the start-up choice between it and
torch's default kernel (cpu_engine/packed.py)."""

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from cpu_engine import packed  # noqa: E402
from cpu_engine.packed import KernelCost, PackedLinear, choose_linear_kernel, pack_linear_layers  # noqa: E402
from cpu_engine.quantize import quantize_linear  # noqa: E402

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch has no oneDNN linear kernel")


def tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32, bias=False))


def test_a_packed_layer_computes_the_linear_layer_for_any_leading_shape():
    linear = nn.Linear(64, 48)
    layer = PackedLinear(linear)
    x = torch.randn(2, 5, 64)
    with torch.inference_mode():
        assert layer(x).shape == (2, 5, 48)
        torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)


def test_packing_replaces_the_float_linear_layers_only():
    model = tiny_model()
    quantized, _ = quantize_linear(nn.Linear(64, 64), "int8")
    model.append(quantized)
    assert pack_linear_layers(model) == 2
    assert [type(m).__name__ for m in model] == ["PackedLinear", "ReLU", "PackedLinear", "Int8WeightOnlyLinear"]


@pytest.mark.parametrize("kernel, expected", [("default", "Linear"), ("onednn-packed", "PackedLinear")])
def test_a_named_kernel_is_used_unmeasured(monkeypatch, kernel, expected):
    monkeypatch.setattr(packed, "_costs", lambda *args: pytest.fail("measured"))
    model = tiny_model()
    assert choose_linear_kernel(model, 64, kernel) == kernel
    assert type(model[0]).__name__ == expected


def test_an_unknown_kernel_is_refused_by_name():
    with pytest.raises(ValueError, match="linear_kernel must be one of auto, default, onednn-packed, got 'mkl'"):
        choose_linear_kernel(tiny_model(), 64, "mkl")


@pytest.mark.parametrize("default, prepacked, expected", [
    (KernelCost(4, 0.5, 0.6), KernelCost(1, 0.25, 0.4), "onednn-packed"),  # lower floor, faster
    (KernelCost(1, 0.2, 0.3), KernelCost(1, 0.25, 0.4), "default"),  # the default is faster
    (KernelCost(1, 0.2, 0.3), KernelCost(1, 0.2, 0.26), "default"),  # within timing noise: no switch
    (KernelCost(None, float("inf"), float("inf")), KernelCost(2, 0.3, 0.4), "onednn-packed"),  # default never agrees
    (KernelCost(4, 0.5, 0.6), KernelCost(None, float("inf"), float("inf")), "default"),  # packed never agrees
])
def test_auto_keeps_the_kernel_that_costs_less_where_its_rows_agree(monkeypatch, default, prepacked, expected):
    monkeypatch.setattr(packed, "_costs", lambda *args: {"default": default, "onednn-packed": prepacked})
    model = tiny_model()
    assert choose_linear_kernel(model, 64) == expected
    assert isinstance(model[0], PackedLinear) == (expected == "onednn-packed")


def test_auto_measures_floors_and_times_of_both_kernels():
    model = tiny_model()
    chosen = choose_linear_kernel(model, 64)
    assert chosen in ("default", "onednn-packed")
    with torch.inference_mode():
        assert model(torch.randn(3, 64)).shape == (3, 32)


def test_the_measure_tool_times_each_kernel(tmp_path, capsys):
    from tools import measure_forwards as measure
    from tests.tiny_models import write_tiny_qwen2

    model_dir = write_tiny_qwen2(tmp_path)
    measure.main(["--model-dir", str(model_dir), "--dtypes", "float32", "--tokens", "1,2", "--context", "4",
                  "--repeats", "1", "--linear-kernels", "default,onednn-packed"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {model_dir.name} ")]
    assert [row.split(" | ")[3] for row in rows] == ["default", "onednn-packed"]
    with pytest.raises(SystemExit):
        measure.main(["--model-dir", str(model_dir), "--linear-kernels", "mkl"])
    assert "--linear-kernels: unknown mkl" in capsys.readouterr().err


def _mapped(path) -> bool:
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(str(path)) for line in maps)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_a_packed_model_lets_go_of_its_memory_mapped_checkpoint(tmp_path):
    """Packing reads every replaced weight's pages; a bias or norm still pointing
    into the mapped checkpoint would keep them resident beside the packed copies."""
    import gc

    from transformers import AutoModelForCausalLM

    from tests.tiny_models import write_tiny_qwen2

    model_dir = write_tiny_qwen2(tmp_path)
    checkpoint = (model_dir / "model.safetensors").resolve()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if not _mapped(checkpoint):
        pytest.skip("this transformers copies the checkpoint instead of mapping it")
    inputs = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        before = model(inputs).logits
    assert pack_linear_layers(model) > 0
    gc.collect()
    assert not _mapped(checkpoint)
    with torch.inference_mode():
        torch.testing.assert_close(model(inputs).logits, before, rtol=1e-5, atol=1e-5)


def test_the_kernels_are_timed_in_turn_so_a_burst_of_load_slows_both(monkeypatch):
    calls = []

    class Recording(nn.Linear):
        def __init__(self, name):
            super().__init__(16, 8)
            self.name = name

        def forward(self, x):
            calls.append(self.name)
            return super().forward(x)

    monkeypatch.setattr(packed, "invariant_floor", lambda *args: 1)
    shape = (16, 8, True, torch.float32)
    kernels = {"default": {shape: (Recording("default"), 3)}, "onednn-packed": {shape: (Recording("packed"), 3)}}
    costs = packed._costs(kernels, 8, torch.Generator().manual_seed(0))
    timed = calls[4:]  # after one warm-up call per kernel and row count
    assert len(timed) == 4 * packed._TIMING_REPEATS
    assert all(timed[i:i + 4] == ["default", "default", "packed", "packed"] for i in range(0, len(timed), 4))
    assert {name: cost.floor for name, cost in costs.items()} == {"default": 1, "onednn-packed": 1}
    assert all(cost.step_seconds > 0 and cost.verify_seconds > 0 for cost in costs.values())
