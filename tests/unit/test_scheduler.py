"""In-flight batching decisions (cpu_engine/scheduler.py), with a
fake forward: which rows each forward carries, chunked prefill, and how
finished and failed calls leave."""

import numpy as np
import pytest

from cpu_engine.scheduler import Call, Scheduler
from coordinator.sampling.params import SamplingParams

VOCAB = 16


def call(prompt_length, new_tokens=3, drafts=(), reused=0):
    return Call(np.arange(1, prompt_length + 1) % VOCAB, new_tokens, SamplingParams(), None, list(drafts), None,
                sequence=object(), reused=reused)


def fake_logits(works):
    """Logits whose argmax is (token + 1) % VOCAB for every row."""
    out = []
    for work in works:
        if not work.logits:
            out.append(None)
            continue
        rows = np.zeros((len(work.tokens), VOCAB), dtype=np.float32)
        rows[np.arange(len(work.tokens)), (np.asarray(work.tokens) + 1) % VOCAB] = 1.0
        out.append(rows)
    return out


def step(scheduler):
    works = scheduler.next_forward()
    return works, scheduler.finish(works, fake_logits(works))


def test_decode_rows_go_first_and_a_long_prompt_is_prefilled_in_the_rest_of_the_budget():
    scheduler = Scheduler(capacity=16)
    running = [call(4, new_tokens=10, reused=3), call(5, new_tokens=10, drafts=(6, 7, 8), reused=4)]
    long_prompt = call(40, new_tokens=2)
    for c in (*running, long_prompt):
        scheduler.add(c)
    works, _ = step(scheduler)
    # the plain call's 1 row and the verification's 4, then 11 prompt tokens
    assert [(w.call, len(w.tokens), w.logits) for w in works] == [
        (running[0], 1, True), (running[1], 4, True), (long_prompt, 11, False)]
    assert running[1].finished  # a verification is one forward
    forwards = 1
    while long_prompt.prefill_left:
        works, _ = step(scheduler)
        forwards += 1
        assert sum(len(w.tokens) for w in works) <= 16
        assert works[0].call is running[0] and len(works[0].tokens) == 1  # the stream advanced every forward
    # 39 prompt tokens to prefill (the last one is decoded): 11, then 15 a forward
    assert forwards == 3 and long_prompt.decode_rows() == 1


def test_plain_decoding_continues_until_its_budget_and_reports_the_tokens_it_feeds():
    scheduler = Scheduler(capacity=8)
    streamed = []
    plain = call(3, new_tokens=4)
    plain.on_tokens = lambda c, tokens: streamed.append(tokens)
    scheduler.add(plain)
    done = []
    while not done:
        _, done = step(scheduler)
    assert done == [plain] and len(scheduler) == 0
    assert plain.result.tokens == [4, 5, 6, 7] and streamed == [[4], [5], [6], [7]]
    assert plain.result.fed == 3  # the last token is not fed back
    assert list(plain.cached_tokens()) == [1, 2, 3, 4, 5, 6]


def test_a_short_catch_up_is_prefilled_before_prompts_that_arrived_earlier():
    # Eight prompts' prefills queued (the draft's warm-ups in a crowd), then a
    # stream's draft call that must first catch up on two verified tokens: it
    # goes into the next forward, not behind 8 x 50 prompt tokens.
    scheduler = Scheduler(capacity=8)
    prompts = [call(51) for _ in range(8)]
    for c in prompts:
        scheduler.add(c)
    step(scheduler)
    catch_up = call(53, new_tokens=4, reused=50)
    scheduler.add(catch_up)
    works, _ = step(scheduler)
    # its two tokens, and its first decode row in the same forward
    assert [(w.call, len(w.tokens), w.logits) for w in works] == [
        (catch_up, 2, False), (catch_up, 1, True), (prompts[0], 5, False)]
    forwards = 1
    while not catch_up.finished:
        works, _ = step(scheduler)
        forwards += 1
        assert works[0].call is catch_up  # its decode rows go first
    assert forwards == 4 and catch_up.result.tokens == [54 % VOCAB, 55 % VOCAB, 56 % VOCAB, 57 % VOCAB]
    # the prompts still go in arrival order among themselves
    assert prompts[0].prefill_left == 50 - 8 - 5 - 3 * 7 == 16
    assert all(c.prefill_left == 50 for c in prompts[1:])


def test_a_verification_larger_than_what_is_left_waits_for_the_next_forward():
    scheduler = Scheduler(capacity=8)
    first, second = call(3, drafts=(4, 5, 6, 7), reused=2), call(3, drafts=(4, 5, 6), reused=2)
    scheduler.add(first)
    scheduler.add(second)
    works, done = step(scheduler)
    assert [w.call for w in works] == [first] and done == [first]
    works, done = step(scheduler)
    assert [w.call for w in works] == [second] and done == [second]


def test_a_call_whose_rows_fail_leaves_alone():
    scheduler = Scheduler(capacity=8)
    good, bad = call(3, reused=2), call(3, drafts=(1, 2), reused=2)
    scheduler.add(good)
    scheduler.add(bad)
    works = scheduler.next_forward()
    logits = fake_logits(works)
    logits[1] = None  # no logits for rows that need them
    done = scheduler.finish(works, logits)
    assert done == [bad] and isinstance(bad.error, Exception) and not good.finished
    assert scheduler.fail_all(scheduler.next_forward(), RuntimeError("boom")) == [good]
    assert isinstance(good.error, RuntimeError) and len(scheduler) == 0


def test_the_budget_must_hold_a_row():
    with pytest.raises(ValueError, match="at least one row"):
        Scheduler(capacity=0)


def test_a_prompt_alone_fills_the_forward_and_next_to_streams_takes_one_shared_chunk():
    scheduler = Scheduler(capacity=64, shared_prefill=8)
    long_prompt = call(101, new_tokens=2)
    scheduler.add(long_prompt)
    works, _ = step(scheduler)
    assert [len(w.tokens) for w in works] == [64]  # nothing else running: the whole budget
    stream = call(4, new_tokens=10, reused=3)
    scheduler.add(stream)
    works, _ = step(scheduler)
    # a stream decodes: the prompt gets one shared chunk next to it, so its next token waits little
    assert [(w.call, len(w.tokens)) for w in works] == [(stream, 1), (long_prompt, 8)]
    works, _ = step(scheduler)
    assert [(w.call, len(w.tokens)) for w in works] == [(stream, 1), (long_prompt, 8)]
    assert long_prompt.prefill_left == 100 - 64 - 16


def test_decode_rows_over_the_shared_chunk_still_leave_prompts_one_chunk():
    scheduler = Scheduler(capacity=64, shared_prefill=8)
    streams = [call(12, new_tokens=5, drafts=tuple(range(1, 9)), reused=11) for _ in range(2)]
    prompt = call(30)
    for c in (*streams, prompt):
        scheduler.add(c)
    works, _ = step(scheduler)
    assert [len(w.tokens) for w in works] == [9, 9, 8]  # 18 decode rows, and still a chunk of the prompt


def test_the_forward_that_ends_a_prompt_decodes_its_first_token_where_it_fits():
    scheduler = Scheduler(capacity=16)
    short, verify = call(10, new_tokens=3), call(8, drafts=(1, 2, 3))
    scheduler.add(short)
    works, _ = step(scheduler)
    assert [(len(w.tokens), w.logits) for w in works] == [(9, False), (1, True)]
    assert short.plain.tokens == [11]  # the first token came out of the prompt's own forward
    scheduler.add(verify)  # 7 prompt tokens and 4 verification rows: 11 > 16 - 1 left after the stream
    works, _ = step(scheduler)
    assert [(w.call, len(w.tokens), w.logits) for w in works] == [
        (short, 1, True), (verify, 7, False), (verify, 4, True)]
    assert verify.finished
    long_prompt = call(16)  # the whole budget for its 15 prompt tokens: the first token waits
    scheduler = Scheduler(capacity=15)
    scheduler.add(long_prompt)
    works, _ = step(scheduler)
    assert [(len(w.tokens), w.logits) for w in works] == [(15, False)] and long_prompt.decode_rows() == 1


def test_prompts_that_arrive_together_are_prefilled_in_turn_shortest_first():
    """A forward that ends one prompt and holds a block of rows takes no second prompt:
    its rows would delay the first prompt's first token and gain the second nothing."""
    scheduler = Scheduler(capacity=512, shared_prefill=64)
    prompts = [call(151, new_tokens=4), call(120, new_tokens=4), call(151, new_tokens=4)]
    for c in prompts:
        scheduler.add(c)
    works, _ = step(scheduler)
    # the shortest prompt alone, with its first decode row; the others wait whole
    assert [(w.call, len(w.tokens), w.logits) for w in works] == [(prompts[1], 119, False), (prompts[1], 1, True)]
    assert prompts[1].plain.tokens and prompts[0].prefill_left == prompts[2].prefill_left == 150
    works, _ = step(scheduler)
    # next to the stream now decoding: one shared block of the next prompt, in arrival order
    assert [(w.call, len(w.tokens)) for w in works] == [(prompts[1], 1), (prompts[0], 64)]
    # a catch-up of a few tokens still shares the forward with a prompt's prefill
    scheduler = Scheduler(capacity=512, shared_prefill=64)
    catch_up, prompt = call(10, reused=4), call(151)
    scheduler.add(prompt)
    scheduler.add(catch_up)
    works, _ = step(scheduler)
    assert [(w.call, len(w.tokens)) for w in works] == [(catch_up, 5), (catch_up, 1), (prompt, 150), (prompt, 1)]


def test_a_prompts_leading_blocks_are_taken_a_whole_block_at_a_time():
    """Rows through the prompt's larger kernel calls (cpu_engine/prompt_blocks.py)
    come in whole blocks: alone as many as fit, next to streams one block in
    place of the shared chunk; the rest of the prompt as before."""
    scheduler = Scheduler(capacity=64, shared_prefill=8, prompt_block=16)
    prompt = call(61, new_tokens=2)
    prompt.prompt_path = 48  # (61 - 1) // 16 * 16
    scheduler.add(prompt)
    works, _ = step(scheduler)
    # alone: its blocks, the rest of the prompt and its first decode row in one forward, as without blocks
    assert [(len(w.tokens), w.logits) for w in works] == [(60, False), (1, True)]
    scheduler = Scheduler(capacity=64, shared_prefill=8, prompt_block=16)
    prompts = [call(61, new_tokens=2), call(61, new_tokens=2)]
    for prompt in prompts:
        prompt.prompt_path = 48
        scheduler.add(prompt)
    works, _ = step(scheduler)
    # two prompts at once: the first whole, the second not started (prefilled in turn)
    assert [(w.call, len(w.tokens), w.logits) for w in works] == [(prompts[0], 60, False), (prompts[0], 1, True)]
    scheduler = Scheduler(capacity=40, shared_prefill=8, prompt_block=16)
    prompt = call(61, new_tokens=2)
    prompt.prompt_path = 48
    scheduler.add(prompt)
    assert [len(w.tokens) for w in step(scheduler)[0]] == [32]  # a forward too small for all blocks: whole blocks
    assert [len(w.tokens) for w in step(scheduler)[0]] == [16 + 12, 1]
    scheduler = Scheduler(capacity=64, shared_prefill=8, prompt_block=16)
    stream, prompt = call(4, new_tokens=10, reused=3), call(61, new_tokens=2)
    prompt.prompt_path = 48
    scheduler.add(stream)
    scheduler.add(prompt)
    works, _ = step(scheduler)
    assert [(w.call, len(w.tokens)) for w in works] == [(stream, 1), (prompt, 16)]  # a block, not 8 rows
    prompt.prefilled = 40  # a cached prefix that ends inside a block: the block's rest
    works, _ = step(scheduler)
    assert [(w.call, len(w.tokens)) for w in works] == [(stream, 1), (prompt, 8)]


def test_a_prompt_after_a_cached_prefix_that_ends_inside_a_block_goes_on_in_block_aligned_chunks():
    """Alone, the first chunk ends where a block does and later ones are whole blocks:
    no block's attention runs in two forwards."""
    scheduler = Scheduler(capacity=32, shared_prefill=8, prompt_block=16)
    prompt = call(61, new_tokens=2, reused=3)
    prompt.prompt_path = 48
    scheduler.add(prompt)
    chunks = []
    while prompt.prefill_left:
        works, _ = step(scheduler)
        chunks += [(prompt.prefilled - len(w.tokens), prompt.prefilled) for w in works if not w.logits]
    assert chunks == [(3, 32), (32, 60)]  # 29 rows to the end of the second block, then 16 + the 12-row rest


def test_a_prompt_whose_last_token_is_on_its_path_ends_in_one_forward_next_to_streams():
    """A padded rest takes the prompt's last token into its call (cpu_engine/prompt_blocks.py):
    the token's decode row rides with it past the shared room, where alone it would pad a
    call of its own; the prefill never takes the last token as a prefill row."""
    scheduler = Scheduler(capacity=64, shared_prefill=8, prompt_block=16)
    stream, prompt = call(4, new_tokens=10, reused=3), call(61, new_tokens=2)
    prompt.prompt_path = 61  # 48 in whole blocks, the 13-row rest padded, its last token too
    scheduler.add(stream)
    scheduler.add(prompt)
    assert [(w.call, len(w.tokens), w.logits) for w in step(scheduler)[0]] == [(stream, 1, True), (prompt, 16, False)]
    prompt.prefilled = 48
    works, _ = step(scheduler)
    assert [(w.call, len(w.tokens), w.logits) for w in works] == [(stream, 1, True), (prompt, 12, False),
                                                                 (prompt, 1, True)]
    plain = call(61, new_tokens=2)
    plain.prompt_path, plain.prefilled = 48, 48  # a rest in small calls: the shared room as before
    scheduler = Scheduler(capacity=64, shared_prefill=8, prompt_block=16)
    scheduler.add(call(4, new_tokens=10, reused=3))
    scheduler.add(plain)
    assert [len(w.tokens) for w in step(scheduler)[0]] == [1, 8]
