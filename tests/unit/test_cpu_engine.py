"""The CPU engine on a tiny random Qwen2 model: contract semantics and KV reuse."""

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cpu_engine.engine import CausalLMEngine, EngineRequest, EngineRequestError, resolve_dtype  # noqa: E402
from coordinator.sampling.params import SamplingParams  # noqa: E402
from tests.tiny_models import write_tiny_qwen2  # noqa: E402

PROMPT = np.array([3, 14, 15, 9, 26, 5], dtype=np.int32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_qwen2(tmp_path_factory.mktemp("tiny"))


def engine(model_dir, cached=4, context=128):
    return CausalLMEngine(str(model_dir), dtype="float32", num_threads=1, max_cached_sequences=cached,
                          max_context_tokens=context)


def test_generation_with_prefix_reuse_equals_generation_from_scratch(model_dir):
    cold, warm = engine(model_dir, cached=0), engine(model_dir)
    sequence = list(PROMPT)
    for _ in range(4):  # rounds of a sequence, each resending the whole context
        expected = cold.run(EngineRequest(np.array(sequence), 3)).tokens
        result = warm.run(EngineRequest(np.array(sequence), 3))
        assert result.tokens == expected
        sequence += expected
    assert result.reused_tokens == len(sequence) - 3 - 1  # everything but the newest tokens came from the cache


def test_verification_returns_accepted_prefix_plus_one_target_token(model_dir):
    e = engine(model_dir)
    greedy = e.run(EngineRequest(PROMPT, 6)).tokens
    all_good = e.run(EngineRequest(PROMPT, 5, draft_tokens=np.array(greedy[:4])))
    assert all_good.tokens == greedy[:5]  # 4 accepted + bonus
    wrong = [greedy[0], greedy[1], (greedy[2] + 1) % 64, greedy[3]]
    partial = e.run(EngineRequest(PROMPT, 5, draft_tokens=np.array(wrong)))
    assert partial.tokens == greedy[:3]  # 2 accepted + the target's own third token
    # the cache after a partial acceptance is still right for the next round
    follow = e.run(EngineRequest(np.concatenate([PROMPT, partial.tokens]), 3)).tokens
    assert follow == greedy[3:6]


def test_generation_logits_and_draft_logits_rejection_path(model_dir):
    e = engine(model_dir)
    sampling = SamplingParams(temperature=1.0, seed=5)
    draft = e.run(EngineRequest(PROMPT, 3, sampling=sampling, return_logits=True))
    assert draft.logits.shape == (3, 64)
    verified = e.run(EngineRequest(PROMPT, 4, sampling=sampling, draft_tokens=np.array(draft.tokens),
                                   draft_logits=draft.logits, return_logits=True))
    # same model as draft and target: p == q, so every draft token is accepted
    assert verified.tokens[:3] == draft.tokens and len(verified.tokens) == 4
    assert verified.logits.shape == (4, 64)


def test_seeded_sampling_is_reproducible(model_dir):
    e = engine(model_dir)
    sampling = SamplingParams(temperature=1.0, seed=11)
    assert e.run(EngineRequest(PROMPT, 8, sampling=sampling)).tokens == e.run(
        EngineRequest(PROMPT, 8, sampling=sampling)).tokens


@pytest.mark.parametrize(
    "request_kwargs,message",
    [
        (dict(input_ids=np.array([], dtype=np.int32), max_new_tokens=1), "input_ids is empty"),
        (dict(input_ids=PROMPT, max_new_tokens=0), "request_output_len must be at least 1"),
        (dict(input_ids=np.array([64]), max_new_tokens=1), "token ids must be in [0, 64)"),
        (dict(input_ids=np.arange(60) % 64, max_new_tokens=10), "exceeds max_context_tokens 64"),
        (dict(input_ids=PROMPT, max_new_tokens=3, draft_tokens=np.array([1, 2]),
              draft_logits=np.zeros((3, 64))), "draft_logits must have shape [2, 64]"),
    ],
)
def test_limits_are_enforced_with_named_fields(model_dir, request_kwargs, message):
    e = engine(model_dir, context=64)
    with pytest.raises(EngineRequestError) as error:
        e.run(EngineRequest(**request_kwargs))
    assert message in str(error.value)


def test_cache_pool_is_bounded(model_dir):
    e = engine(model_dir, cached=2)
    for start in range(5):
        e.run(EngineRequest(np.array([start + 1, 7, 8]), 2))
    assert len(e.pool) == 2


def test_auto_dtype_follows_native_bf16_support():
    assert resolve_dtype("auto", "flags\t: fpu avx2 avx512f amx_bf16 amx_tile") == "bfloat16"
    assert resolve_dtype("auto", "flags\t: fpu avx2 fma") == "float32"
    assert resolve_dtype("float32") == "float32"
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        resolve_dtype("int4")


@pytest.mark.parametrize("row_invariant, linear_kernel", [(True, "default"), (True, "onednn-packed"),
                                                          (False, "auto")])
def test_verification_matches_plain_decoding(model_dir, row_invariant, linear_kernel):
    e = CausalLMEngine(str(model_dir), dtype="float32", num_threads=1, row_invariant=row_invariant,
                       linear_kernel=linear_kernel)
    assert e.linear_kernel == linear_kernel or linear_kernel == "auto"
    plain = e.run(EngineRequest(PROMPT, 10, return_logits=True))
    # verify the plain tokens 6 at a time
    verified = e.run(EngineRequest(PROMPT, 7, draft_tokens=np.array(plain.tokens[:6]), return_logits=True))
    assert verified.tokens == plain.tokens[:7]
    if row_invariant:  # bitwise-equal logits however the tokens were batched
        assert np.array_equal(verified.logits, plain.logits[:7])


@pytest.mark.parametrize("linear_kernel", ["default", "onednn-packed"])
def test_calls_in_one_forward_get_what_they_get_alone(model_dir, linear_kernel):
    e = CausalLMEngine(str(model_dir), dtype="float32", num_threads=1, max_cached_sequences=0,
                       linear_kernel=linear_kernel)
    prompts = [PROMPT, np.arange(1, 40), np.array([7, 7, 7])]
    alone = [e.run(EngineRequest(p, 5, return_logits=True)) for p in prompts]
    calls = [e.submit(EngineRequest(p, 5, return_logits=True)) for p in prompts]
    while not all(call.finished for call in calls):
        e.step()
    for call, expected in zip(calls, alone):
        result = e.result(call)
        assert result.tokens == expected.tokens and np.array_equal(result.logits, expected.logits)


def test_a_forward_that_fails_fails_its_calls_and_the_engine_goes_on(model_dir, monkeypatch):
    e = engine(model_dir, cached=0)
    call = e.submit(EngineRequest(PROMPT, 3))

    def broken(works):
        raise RuntimeError("kernel failure")

    monkeypatch.setattr(e, "_forward", broken)
    assert e.step() == [call]
    with pytest.raises(RuntimeError, match="kernel failure"):
        e.result(call)
    monkeypatch.undo()
    assert len(e.run(EngineRequest(PROMPT, 3)).tokens) == 3


def test_a_round_longer_than_max_draft_len_is_refused(model_dir):
    e = CausalLMEngine(str(model_dir), dtype="float32", num_threads=1, max_num_tokens=8)
    with pytest.raises(EngineRequestError, match="exceeds max_draft_len 7"):
        e.run(EngineRequest(PROMPT, 9, draft_tokens=np.arange(1, 9)))
    with pytest.raises(ValueError, match="max_num_tokens must be at least 8"):
        CausalLMEngine(str(model_dir), max_num_tokens=4)
    with pytest.raises(ValueError, match=r"max_draft_len must be between 0 and max_num_tokens - 1 \(7\), got 8"):
        CausalLMEngine(str(model_dir), max_num_tokens=8, max_draft_len=8)


def test_fixed_size_forwards_hold_the_longest_verification(model_dir, monkeypatch):
    """Where no row count is row-invariant (seen with float32 on AVX2-only
    CPUs), every forward has one fixed size: it must still carry
    max_draft_len drafts plus the last token, and verify them as plain
    decoding would."""
    import cpu_engine.engine as engine_module
    from cpu_engine.rows import RowShape

    monkeypatch.setattr(engine_module, "measure_row_shape",
                        lambda model, budget, fixed: RowShape(floor=fixed, budget=fixed, fixed=fixed))
    e = CausalLMEngine(str(model_dir), dtype="float32", num_threads=1, max_draft_len=8)
    assert e.row_shape.fixed == 9
    plain = e.run(EngineRequest(PROMPT, 9)).tokens
    verified = e.run(EngineRequest(PROMPT, 9, draft_tokens=np.array(plain[:8])))
    assert list(verified.tokens) == list(plain)


def test_a_draft_keeps_the_row_shape_only_in_forwards_that_carry_sampled_rows(model_dir, monkeypatch):
    """row_invariant "sampled" (the draft's setting): a greedy call's forwards go unpadded, a
    sampled call's keep the measured shape, so a seeded sampled request repeats its text
    whatever its batch-mates; its tokens and logits equal those of an always-shaped engine."""
    import cpu_engine.engine as engine_module
    from cpu_engine.rows import RowShape

    monkeypatch.setattr(engine_module, "measure_row_shape",
                        lambda model, budget, fixed: RowShape(floor=fixed, budget=fixed, fixed=fixed))
    e = CausalLMEngine(str(model_dir), dtype="float32", num_threads=1, row_invariant="sampled")
    always = CausalLMEngine(str(model_dir), dtype="float32", num_threads=1, row_invariant=True)
    greedy = e.submit(EngineRequest(PROMPT, 3))
    rows = []
    while not greedy.finished:
        e.step()
        rows.append(e.last_forward_rows)
    assert max(rows) < e.row_shape.fixed and rows[-1] == 1  # the prompt, then one row a step, unpadded
    sampled = EngineRequest(PROMPT, 3, sampling=SamplingParams(temperature=0.8, seed=5), return_logits=True)
    call = e.submit(sampled)
    rows = []
    while not call.finished:
        e.step()
        rows.append(e.last_forward_rows)
    assert set(rows) == {e.row_shape.fixed}
    ours, reference = e.result(call), always.run(sampled)
    assert ours.tokens == reference.tokens and np.array_equal(ours.logits, reference.logits)
    with pytest.raises(ValueError, match="row_invariant must be one of true, sampled, false"):
        CausalLMEngine(str(model_dir), dtype="float32", num_threads=1, row_invariant="maybe")


# ---- weight-only quantization (cpu_engine/quantize.py) ----------------------

from cpu_engine import quantize  # noqa: E402

# Relative error (Frobenius norm) of a quantized layer's output against the float
# layer's, on random Gaussian weights: int8 per-channel ~0.4%, int4 groups of 64 ~6%.
QUANTIZATION_TOLERANCE = {"int8": 0.01, "int4": 0.10}


def relative_error(actual, expected):
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_linear_matches_the_float_layer(scheme, dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True).to(dtype)
    layer, description = quantize.quantize_linear(linear, scheme, group_size=64)
    assert description == {"int8": "int8", "int4": "int4 g64"}[scheme]
    x = torch.randn(2, 5, 256, dtype=dtype)  # leading dims are kept
    with torch.no_grad():
        out, expected = layer(x), linear(x)
        # the kernel computes exactly with the weights it stores (up to the dtype's rounding)
        dequantized = x.float() @ layer.dequantized_weight().T + linear.bias.float()
    assert out.shape == (2, 5, 96) and out.dtype == dtype
    assert relative_error(out, expected) < QUANTIZATION_TOLERANCE[scheme]
    assert relative_error(out, dequantized) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert layer(x[:, :0]).shape == (2, 0, 96)


@pytest.mark.parametrize(
    "shape,group_size,expected",
    [
        ((96, 32), 64, "int4 g32"),  # 64 does not divide 96 inputs: the largest allowed group that does
        ((256, 32), 128, "int4 g128"),
        ((64, 24), 64, "int8"),  # 24 outputs: int4 needs a multiple of 16
        ((48, 32), 64, "int8"),  # no int4 group (32..256) divides 48 inputs
        ((40, 32), 64, "none"),  # int8 needs inputs divisible by 16: left in float
    ],
)
def test_int4_group_fallbacks(shape, group_size, expected):
    torch.manual_seed(0)
    linear = torch.nn.Linear(*shape, bias=False)
    layer, description = quantize.quantize_linear(linear, "int4", group_size)
    assert description == expected
    if expected != "none":
        x = torch.randn(3, shape[0])
        with torch.no_grad():
            assert relative_error(layer(x), linear(x)) < QUANTIZATION_TOLERANCE["int4"]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_forwards_over_more_than_dense_rows_use_the_original_weights(scheme):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    layer, _ = quantize.quantize_linear(linear, scheme, dense_rows=4)
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(layer(x), linear(x))  # 5 rows: prefill-sized, dense
        assert torch.equal(layer(x[:4]), quantize.quantize_linear(linear, scheme)[0](x[:4]))  # 4 rows: quantized
        assert not torch.equal(layer(x[:4]), linear(x[:4]))


def _two_layer_model(scheme="int4"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 32))
    quantize.quantize_linear_layers(model, scheme)
    return model


@pytest.mark.parametrize("dense_wins_from, expected", [
    (16, quantize.DENSE_ROWS),  # faster at every probe: above the quantized kernels' block, as before
    (32, 16),
    (64, 32),
    (None, 0),  # never faster: dropped
])
def test_the_original_weights_are_used_only_above_the_rows_where_they_measured_faster(dense_wins_from, expected):
    model = _two_layer_model()
    seen = []

    def measure(layer, rows, generator):
        seen.append((layer.in_features, layer.out_features, rows))
        faster = dense_wins_from is not None and rows >= dense_wins_from
        return (1.0, 2.0) if faster else (2.0, 1.0)

    assert quantize.choose_dense_rows(model, 256, measure) == expected
    # one layer per distinct shape (two 64->32 layers share one), the largest probe first, down to
    # the first where the original weights lose
    lowest_probed = max(quantize.DENSE_PROBE_ROWS) if dense_wins_from is None else dense_wins_from // 2
    probed = [r for r in quantize.DENSE_PROBE_ROWS if r >= lowest_probed]
    assert sorted(seen) == sorted((i, o, r) for i, o in ((64, 32), (32, 64)) for r in probed)
    assert [r for _, _, r in seen[::2]] == sorted(probed, reverse=True)
    layers = list(model)
    assert all(layer.dense_rows == expected for layer in layers)
    assert all((layer.dense_weight is None) == (expected == 0) for layer in layers)
    x = torch.randn(64, 64)
    with torch.no_grad():  # 64 rows: dense only where it was kept
        assert torch.equal(layers[0](x), layers[0]._matmul(x) + layers[0].bias) == (expected == 0)


def test_a_dense_path_faster_at_some_rows_but_not_at_more_is_not_kept():
    """Only a count from which the original weights win at every larger probe is taken."""
    model = _two_layer_model()
    assert quantize.choose_dense_rows(model, 256, lambda layer, rows, g: (1.0, 2.0) if rows == 16 else (2.0, 1.0)) == 0


def test_the_dense_rows_are_weighed_by_how_many_layers_have_each_shape():
    """Two 64->32 layers cost the quantized kernels more than one 32->64 layer saves them."""
    model = _two_layer_model()

    def measure(layer, rows, generator):
        return (1.0, 3.0) if layer.in_features == 64 else (5.0, 1.0)  # dense: 2x1 + 5 = 7; quantized: 2x3 + 1 = 7

    assert quantize.choose_dense_rows(model, 256, measure) == quantize.DENSE_ROWS  # a tie goes to dense


def test_no_probe_fits_a_small_forward_and_nothing_changes():
    model = _two_layer_model()
    assert quantize.choose_dense_rows(model, 8, lambda *a: pytest.fail("measured")) == quantize.DENSE_ROWS
    assert all(layer.dense_weight is not None for layer in model)


def test_unknown_scheme_and_group_size_are_rejected(model_dir):
    with pytest.raises(ValueError, match="weight_quantization must be one of none, int8, int4, got 'fp8'"):
        CausalLMEngine(str(model_dir), weight_quantization="fp8")
    with pytest.raises(ValueError, match="group_size must be one of 32, 64, 128, 256"):
        quantize.quantize_linear_layers(torch.nn.Linear(32, 32), "int4", group_size=48)


@pytest.mark.parametrize("row_invariant", [True, False])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_engine_generates_and_verifies(model_dir, scheme, row_invariant):
    e = CausalLMEngine(str(model_dir), dtype="float32", num_threads=1, row_invariant=row_invariant,
                       weight_quantization=scheme)
    # every linear layer, the tied lm_head included, is quantized (tiny model: hidden size 32, so int4
    # layers reading the hidden state use groups of 32; down_proj reads 64 inputs and keeps groups of 64)
    assert set(e.quantized_layers.values()) == ({"int8"} if scheme == "int8" else {"int4 g32", "int4 g64"})
    assert "lm_head" in e.quantized_layers and not any(
        isinstance(m, torch.nn.Linear) for m in e.model.modules())
    plain = e.run(EngineRequest(PROMPT, 10, return_logits=True))
    verified = e.run(EngineRequest(PROMPT, 7, draft_tokens=np.array(plain.tokens[:6]), return_logits=True))
    assert verified.tokens == plain.tokens[:7]
    if e.row_shape.fixed is None and row_invariant:
        assert np.array_equal(verified.logits, plain.logits[:7])
    # a prompt longer than quantize.DENSE_ROWS (prefilled on the original weights or the quantized kernels, as measured)
    assert len(e.run(EngineRequest(np.arange(1, 2 * quantize.DENSE_ROWS), 3)).tokens) == 3
    # close to the float model's logits on the same tokens
    sequence = torch.as_tensor(np.concatenate([PROMPT, plain.tokens[:6]]).astype(np.int64)).unsqueeze(0)
    with torch.no_grad():
        reference = engine(model_dir).model(input_ids=sequence).logits[0, -7:]
    assert relative_error(torch.from_numpy(verified.logits), reference) < QUANTIZATION_TOLERANCE[scheme]


def test_simulated_speculation_rounds_from_teacher_forced_matches():
    from tools.measure_agreement import speculation_rounds

    # window 2 over 6 positions: [T T] + target token; [F] -> target token; one token left to draft: [T] + target token
    assert speculation_rounds([True, True, True, False, True, False], 2) == (3, 5, 3)
    assert speculation_rounds([True] * 4, 5) == (1, 3, 3)  # the last token is always the target's own


def test_measure_agreement_command_runs(model_dir, tmp_path, capsys):
    from tools.measure_agreement import main
    from tests.tiny_models import write_tokenizer

    write_tokenizer(tmp_path / "tokenizer")
    args = ["--target-dir", str(model_dir), "--draft-dir", str(model_dir), "--tokenizer-dir", str(tmp_path / "tokenizer"),
            "--first", "0", "--last", "1", "--tokens", "6", "--threads", "1",
            "--target-tokens", str(tmp_path / "target.json")]
    main([*args, "--schemes", "int8"])
    main([*args, "--schemes", "none,int4"])  # the second run reuses the target's tokens
    out = capsys.readouterr().out
    assert f"# target tokens from {tmp_path / 'target.json'}" in out
    rows = [line for line in out.splitlines() if line.startswith("| none") or line.startswith("| int4")]
    assert len(rows) == 2
    # 2 prompts x 6 target tokens; the same model as draft and target: (nearly) always agrees
    agreement = re.match(r"\| none \| ([0-9.]+) \((\d+)/12\) \|", rows[0])
    assert agreement and float(agreement.group(1)) >= 0.75, rows[0]


def test_a_cache_that_went_on_differently_is_reused_up_to_where_it_agrees(model_dir):
    """After a rejected draft the next call shares only part of the cached entry:
    that part is reused, and the result is bitwise what a fresh engine computes."""
    cold, warm = engine(model_dir, cached=0), engine(model_dir)
    warm.run(EngineRequest(np.concatenate([PROMPT, [7, 7, 7]]), 3))
    request = EngineRequest(np.concatenate([PROMPT, [7, 9]]), 4, return_logits=True)
    result, expected = warm.run(request), cold.run(request)
    assert result.reused_tokens == len(PROMPT) + 1
    assert result.tokens == expected.tokens and np.array_equal(result.logits, expected.logits)


def test_a_prompt_sharing_a_preamble_copies_it_and_leaves_the_other_sequence_whole(model_dir):
    """Two requests with one preamble: the second starts from a copy of it, and
    the first's next call still finds its whole cache (bitwise as computed fresh)."""
    cold, warm = engine(model_dir, cached=0), engine(model_dir)
    first = list(PROMPT) + [7] * 12
    first += warm.run(EngineRequest(np.array(first), 3)).tokens
    second = EngineRequest(np.array(list(PROMPT) + [9, 9]), 3, return_logits=True)
    result, expected = warm.run(second), cold.run(second)
    assert result.reused_tokens == len(PROMPT)
    assert result.tokens == expected.tokens and np.array_equal(result.logits, expected.logits)
    following = EngineRequest(np.array(first), 2, return_logits=True)
    result, expected = warm.run(following), cold.run(following)
    assert result.reused_tokens == len(first) - 1  # not cropped to the preamble by the other prompt
    assert result.tokens == expected.tokens and np.array_equal(result.logits, expected.logits)


def test_a_prompt_prefilled_in_one_forward_of_blocks_equals_one_prefilled_block_by_block_forward(
        model_dir, monkeypatch):
    """A forward larger than a kernel call's measured rows runs its linear layers in blocks of
    that shape (cpu_engine/row_blocks.py): the prompt's logits and the tokens after it are bitwise
    those of an engine whose forwards hold one block, in fewer forwards."""
    import cpu_engine.engine as engine_module
    from cpu_engine.rows import measure_row_shape

    monkeypatch.setattr(engine_module, "measure_row_shape", lambda model, budget, fixed: measure_row_shape(model, 8, 8))
    prompt = (np.arange(40) * 7 + 3) % 64
    request = EngineRequest(prompt, 6, return_logits=True)
    results, forwards = [], []
    for max_num_tokens in (8, 64):
        e = CausalLMEngine(str(model_dir), dtype="float32", num_threads=1, max_num_tokens=max_num_tokens,
                           max_cached_sequences=0)
        assert e.row_shape.block == 8 and e.row_shape.capacity == max_num_tokens
        results.append(e.run(request))
        forwards.append(e.forwards)
    assert results[1].tokens == results[0].tokens and np.array_equal(results[1].logits, results[0].logits)
    # 39 prompt tokens in 8-row forwards or in one, the last of which decodes the first token; then one a token
    assert forwards == [5 + 5, 1 + 5]


@pytest.mark.parametrize("dense_faster", [True, False])
def test_a_quantized_engine_measures_its_kernel_calls_onto_the_quantized_kernels(model_dir, monkeypatch, dense_faster):
    """Where the dense weights measured faster, quantized layers switch to them over more than
    dense_rows rows (another rounding): the measured block stays at or below it however many rows
    a forward may carry, so a sampled call's rows never meet the dense path. Where they were
    dropped, every row goes through the quantized kernels."""
    import cpu_engine.engine as engine_module

    real = quantize.choose_dense_rows
    monkeypatch.setattr(engine_module, "choose_dense_rows", lambda model, most: real(
        model, most, lambda layer, rows, g: (1.0, 2.0) if dense_faster else (2.0, 1.0)))
    e = CausalLMEngine(str(model_dir), dtype="float32", num_threads=1, max_num_tokens=256,
                       weight_quantization="int4")
    assert e.dense_rows == (quantize.DENSE_ROWS if dense_faster else 0)
    assert e.row_shape.capacity == 256, e.row_shape.describe()
    if dense_faster:
        assert e.row_shape.block <= e.dense_rows, e.row_shape.describe()
    assert not any(getattr(m, "dense_weight", None) is not None for m in e.model.modules()) != dense_faster
    assert len(e.run(EngineRequest(np.arange(1, 40), 3)).tokens) == 3


def test_logits_match_the_model_run_by_transformers_whatever_the_forwards_carried(model_dir):
    """The engine's logits for a prompt and its greedy continuation are the model's own (transformers,
    one forward over the whole sequence): positions stay right when a prompt's last chunk and its
    first decode row share a forward, and when the prompt is prefilled in several chunks."""
    prompt = (np.arange(23) * 5 + 1) % 64
    for max_num_tokens in (8, 64):
        e = CausalLMEngine(str(model_dir), dtype="float32", num_threads=1, max_num_tokens=max_num_tokens,
                           max_cached_sequences=0)
        result = e.run(EngineRequest(prompt, 5, return_logits=True))
        sequence = torch.as_tensor(np.concatenate([prompt, result.tokens[:4]]).astype(np.int64)).unsqueeze(0)
        with torch.no_grad():
            reference = e.model(input_ids=sequence).logits[0, -5:]
        assert torch.allclose(torch.from_numpy(result.logits), reference, atol=1e-4), max_num_tokens


@pytest.mark.parametrize("rest", [None, 64])
def test_a_prompts_blocks_in_larger_calls_keep_speculation_identical_to_plain_decoding(model_dir, rest):
    """prompt_length sends a prompt's leading whole blocks (and its rest, padded to
    ``rest`` rows) through calls of those sizes (cpu_engine/prompt_blocks.py):
    plain decoding, verification rounds, a cached shorter prompt and a batch-mate
    leave the text as it is."""
    from cpu_engine.prompt_blocks import PromptBlock

    e = CausalLMEngine(str(model_dir), dtype="float32", num_threads=1, max_cached_sequences=4,
                       max_context_tokens=512, max_num_tokens=256, prompt_block="128")
    assert e.row_shape.prompt_block == 128 and e.prompt_attention, e.row_shape.describe()
    e.prompt_block = PromptBlock(128, ((rest, 1e-6),) if rest else (), small=1.0)
    calls = []
    probe = e.model.model.layers[0].mlp.down_proj.inner
    probe.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    prompt = (np.arange(300) * 7 + 3) % 64
    e.run(EngineRequest(prompt, 1, prompt_length=300))
    if rest:  # one forward: the prompt's last token in the rest's call, not a small call of its own
        assert calls == [128, 128, 64]
    e.pool.clear()
    calls.clear()
    plain = e.run(EngineRequest(prompt, 12, prompt_length=300)).tokens
    # positions 0-255 in two 128-row calls; 256-298 (43 rows) in small ones or one 64-row call, padded
    assert calls.count(128) == 2 and calls.count(64) == (1 if rest else 0)
    assert max(c for c in calls if c not in (128, 64)) <= e.row_shape.block

    def speculate(engine):
        out = []
        while len(out) < 12:
            guess = [(t + (i == 2)) % 64 for i, t in enumerate(plain[len(out) : len(out) + 4])]
            out += engine.run(EngineRequest(np.concatenate([prompt, out]).astype(np.int64), len(guess) + 1,
                                            draft_tokens=np.array(guess), prompt_length=300)).tokens
        return out[:12]

    e.pool.clear()
    assert speculate(e) == plain
    e.pool.clear()
    e.run(EngineRequest(prompt[:200], 8, prompt_length=200))  # a shorter prompt and its continuation, cached
    assert speculate(e) == plain
    e.pool.clear()
    other = e.submit(EngineRequest((np.arange(280) * 5) % 64, 10, prompt_length=280))
    mine = e.submit(EngineRequest(prompt, 12, prompt_length=300))
    while not (other.finished and mine.finished):
        e.step()
    assert e.result(mine).tokens == plain
    # the cache holds the prompt's blocks on their path: a call without prompt_length reuses none of them
    assert e.run(EngineRequest(prompt, 1)).reused_tokens == 0


@pytest.mark.parametrize("value", [0, 7])
def test_a_prompt_length_outside_the_input_is_refused_with_its_name(value):
    from trtllm_emulation.requests import read_request

    tensors = {"input_ids": np.array([[3, 4, 5]], dtype=np.int32), "prompt_length": np.array([[value]], dtype=np.int32)}
    with pytest.raises(EngineRequestError, match=rf"prompt_length must be between 1 and input_lengths \(3\), got {value}"):
        read_request(tensors.get)
    tensors["prompt_length"] = np.array([[2]], dtype=np.int32)
    assert read_request(tensors.get).prompt_length == 2


def test_a_prompts_last_token_joins_its_prompt_rows_attention_call():
    """A prompt's last token is its own work; where it follows the same sequence's
    prompt rows in the forward, one segment (one attention call per block) carries both."""
    from cpu_engine import attention
    from cpu_engine.engine import _add_segment

    sequence, other = attention.SequenceKV(1), attention.SequenceKV(1)
    segments: list[attention.Segment] = []
    _add_segment(segments, attention.Segment(0, 98, sequence, 98))
    _add_segment(segments, attention.Segment(98, 99, sequence, 1))
    assert segments == [attention.Segment(0, 99, sequence, 99)]
    _add_segment(segments, attention.Segment(99, 100, other, 1))  # another sequence: its own
    _add_segment(segments, attention.Segment(100, 104, other, 0))  # decode rows after prompt rows
    _add_segment(segments, attention.Segment(104, 105, other, 1))  # after rows off the prompt path: apart
    assert [(s.start, s.stop, s.prompt_rows) for s in segments] == [(0, 99, 99), (99, 104, 1), (104, 105, 1)]
