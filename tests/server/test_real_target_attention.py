"""Per-sequence, row-invariant attention on the real target, end to end: a
verification equals plain decoding bitwise, and a request's output is the same
alone and in a crowd (the random-tensor checks: tests/unit/test_attention.py)."""

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cpu_engine import attention  # noqa: E402

TOKENS = 32
# Draft counts of successive verify rounds, repeated until all TOKENS are
# verified: each chain starts at the prompt and continues from the previous
# round's cache, as speculation does; together the two chains verify every
# draft count from 1 to 7. The prompts (118 and 166 tokens) plus 32 tokens
# cross a KEY_BLOCK boundary, so some blocks are computed in two passes.
CHAINS = [(1, 2, 3, 4, 5, 6, 7), (7, 6, 5, 4, 3, 2, 1)]


def served_dtype() -> str:
    """The dtype the server's target engine computes in on this machine (its
    config says ``auto``: bfloat16 where the CPU has native bfloat16, else float32)."""
    from cpu_engine.engine import resolve_dtype
    from tests._config_helpers import model_config, parameter

    return resolve_dtype(parameter(model_config("target", "cpu"), "dtype"))


@pytest.mark.slow
def test_real_target_verification_is_bitwise_plain_decoding(real_target_dir):
    """The real target, found (or prepared) where the server keeps it: SPECDEC_CACHE_DIR, else ~/.cache/specdec,
    in the dtype the server runs it in here."""
    from tokenizers import Tokenizer

    from tools.prompts import load_humaneval
    from cpu_engine.engine import CausalLMEngine, EngineRequest

    engine = CausalLMEngine(str(real_target_dir), dtype=served_dtype(), num_threads=2)
    tokenizer = Tokenizer.from_file(str(real_target_dir / "tokenizer.json"))
    problems = load_humaneval()
    for task in ("HumanEval/0", "HumanEval/17"):
        prompt = tokenizer.encode(problems[task], add_special_tokens=True).ids
        assert len(prompt) // attention.KEY_BLOCK < (len(prompt) + TOKENS - 1) // attention.KEY_BLOCK, task
        plain = engine.run(EngineRequest(np.array(prompt), TOKENS, return_logits=True))
        assert len(plain.tokens) == TOKENS
        for chain in CHAINS:
            start = 0
            for drafts in itertools.cycle(chain):
                drafts = min(drafts, TOKENS - start - 1)
                if drafts < 1:
                    break
                request = EngineRequest(np.array(prompt + plain.tokens[:start]), drafts + 1,
                                        draft_tokens=np.array(plain.tokens[start : start + drafts]), return_logits=True)
                verified = engine.run(request)
                stop = start + drafts + 1
                assert verified.tokens == plain.tokens[start:stop], (task, chain, start, drafts)
                assert np.array_equal(verified.logits, plain.logits[start:stop]), (task, chain, start, drafts)
                start = stop


@pytest.mark.slow
def test_real_target_output_is_the_same_alone_and_in_a_crowd(real_target_dir):
    """In-flight batching: a request's tokens and logits are bitwise the same
    whether the target serves it alone or in forwards shared with other
    sequences (plain decoding, verifications and prompt prefills of others).

    The engine has the server's dtype, threads, max_num_tokens and
    max_draft_len, and no prefix cache (every call prefills). The rows of one
    kernel call are measured at start-up (cpu_engine/rows.py) and a forward
    of more rows (here the first, all four prompts' prefills) runs its linear
    layers in blocks of that shape (cpu_engine/row_blocks.py): a forward still
    carries up to max_num_tokens rows, so the scheduler builds the same crowd
    on every machine; what is tested is what the server relies on, that a row
    does not depend on what else its forward carries, nor on where the blocks
    of a large forward cut it."""
    from tokenizers import Tokenizer

    from tools.prompts import load_humaneval
    from cpu_engine.engine import CausalLMEngine, EngineRequest
    from tests._config_helpers import model_config, parameter

    served = model_config("target", "cpu")
    max_num_tokens = int(parameter(served, "max_num_tokens"))
    engine = CausalLMEngine(str(real_target_dir), dtype=served_dtype(),
                            num_threads=int(parameter(served, "num_threads")), max_cached_sequences=0,
                            max_num_tokens=max_num_tokens, max_draft_len=int(parameter(served, "max_draft_len")))
    assert engine.row_shape.capacity == max_num_tokens, engine.row_shape.describe()
    tokenizer = Tokenizer.from_file(str(real_target_dir / "tokenizer.json"))
    problems = load_humaneval()
    prompts = [tokenizer.encode(problems[task], add_special_tokens=True).ids
               for task in ("HumanEval/2", "HumanEval/11", "HumanEval/23")]
    alone = engine.run(EngineRequest(np.array(prompts[0]), 12, return_logits=True))
    start = 5  # verify plain tokens 5.. with 4 drafts, next to the others
    verify = EngineRequest(np.array(prompts[0] + alone.tokens[:start]), 5,
                           draft_tokens=np.array(alone.tokens[start:start + 4]), return_logits=True)
    crowd = [engine.submit(EngineRequest(np.array(prompts[0]), 12, return_logits=True)),
             engine.submit(EngineRequest(np.array(prompts[1]), 9)),
             engine.submit(verify),
             engine.submit(EngineRequest(np.array(prompts[2] * 2), 3))]  # a prefill longer than the row budget
    sizes = set()
    while not all(call.finished for call in crowd):
        engine.step()
        sizes.add(engine.last_forward)
    print(f"crowd forwards (sequences, rows): {sorted(sizes)}; {engine.row_shape.describe()}")
    assert max(sequences for sequences, _ in sizes) >= 3, sorted(sizes)  # the calls did share forwards
    assert max(rows for _, rows in sizes) > engine.row_shape.block, sorted(sizes)  # and one ran in blocks
    together = engine.result(crowd[0])
    assert together.tokens == alone.tokens and np.array_equal(together.logits, alone.logits)
    verified = engine.result(crowd[2])
    assert verified.tokens == alone.tokens[start:start + 5]
    assert np.array_equal(verified.logits, alone.logits[start:start + 5])


@pytest.mark.slow
def test_the_measured_row_shape_holds_on_the_targets_own_activations(real_target_dir):
    """The start-up probe multiplies random rows; a kernel path that rounds only
    some rows differently can hide from a few of them. Here every linear shape
    of the real target gets the rows it meets in a prompt's prefill (its own
    activations), and every row count the measured shape allows must give each
    of them bitwise what a call of the whole budget gives."""
    from tokenizers import Tokenizer

    from tools.prompts import load_humaneval
    from cpu_engine.engine import CausalLMEngine, EngineRequest
    from cpu_engine.rows import disagreeing_count

    engine = CausalLMEngine(str(real_target_dir), dtype=served_dtype(), num_threads=2, max_cached_sequences=0)
    shape = engine.row_shape
    if shape.fixed is not None:
        pytest.skip(f"this machine's kernels are not row-invariant here: {shape.describe()}")
    tokenizer = Tokenizer.from_file(str(real_target_dir / "tokenizer.json"))
    prompt = tokenizer.encode(load_humaneval()["HumanEval/10"], add_special_tokens=True).ids
    layers, seen, inputs = [], set(), {}
    for module in engine.model.modules():
        inner = getattr(module, "inner", None)  # the row-blocked wrapper of every linear layer
        if inner is not None and (inner.in_features, inner.out_features) not in seen:
            seen.add((inner.in_features, inner.out_features))
            layers.append(inner)
    hooks = [layer.register_forward_hook(
        lambda layer, args, out: inputs.setdefault(id(layer), []).append(args[0].reshape(-1, args[0].shape[-1])))
        for layer in layers]
    # the output layer computes only the rows whose logits are wanted: it gets every final hidden row
    hooks.append(engine.model.model.norm.register_forward_hook(
        lambda norm, args, out: inputs.setdefault("final", []).append(out.reshape(-1, out.shape[-1]))))
    try:
        engine.run(EngineRequest(np.array(prompt), 1))
    finally:
        for hook in hooks:
            hook.remove()
    with torch.inference_mode():
        for layer in layers:
            rows = torch.cat(inputs[id(layer)] if layer.out_features != engine.vocab_size else inputs["final"])
            rows = rows[: 2 * shape.budget]
            assert rows.shape[0] == 2 * shape.budget, (layer, rows.shape)
            worst = disagreeing_count(layer, rows, shape.budget, range(shape.floor, shape.budget + 1))
            assert worst is None, (layer, worst, shape.describe())


@pytest.mark.slow
def test_a_prompts_blocks_give_the_same_bits_however_the_prefill_was_cut(real_target_dir):
    """The real target as served (forwards of up to 512 rows, the prompt block
    measured at start-up), a prompt sent with its length: its first tokens'
    logits are bitwise the same prefilled alone, from a cached prefix that ends
    inside a block, next to a decoding stream, and verified with drafts."""
    from tokenizers import Tokenizer

    from tools.prompts import load_humaneval
    from cpu_engine.engine import CausalLMEngine, EngineRequest
    from tests._config_helpers import model_config, parameter

    served = model_config("target", "cpu")
    engine = CausalLMEngine(str(real_target_dir), dtype=served_dtype(), num_threads=2,
                            max_num_tokens=int(parameter(served, "max_num_tokens")),
                            prompt_block=parameter(served, "prompt_block"))
    block = engine.row_shape.prompt_block
    if block is None:
        pytest.skip(f"no prompt block pays on this machine: {engine.row_shape.describe()}")
    tokenizer = Tokenizer.from_file(str(real_target_dir / "tokenizer.json"))
    problems = load_humaneval()
    text = "".join(problems[f"HumanEval/{i}"] for i in range(20, 40))
    prompt = np.array(tokenizer.encode(text, add_special_tokens=True).ids[: 2 * block + block // 2 + 7])
    length = len(prompt)

    def run(ids=prompt, tokens=4, **kwargs):
        return engine.run(EngineRequest(ids, tokens, return_logits=True, prompt_length=len(ids), **kwargs))

    alone = run()
    engine.pool.clear()
    other = prompt.copy()
    other[block + 5 :] = (other[block + 5 :] + 1) % 1000  # shares a block and 5 rows of the second
    run(other)
    cut = run()
    assert cut.reused_tokens == block + 5
    engine.pool.clear()
    stream = engine.submit(EngineRequest(np.array(prompt[:100]), 24, prompt_length=100))
    while not stream.plain.tokens:
        engine.step()
    beside = engine.submit(EngineRequest(prompt, 4, return_logits=True, prompt_length=length))
    while not beside.finished:
        engine.step()
    crowded = engine.result(beside)
    engine.pool.clear()
    verified = run(tokens=4, draft_tokens=np.array(alone.tokens[:3]))
    for name, result in (("cut", cut), ("beside a stream", crowded)):
        assert result.tokens == alone.tokens and np.array_equal(result.logits, alone.logits), name
    assert verified.tokens == alone.tokens and np.array_equal(verified.logits, alone.logits)
