import numpy as np
import pytest

from cpu_engine.kv_pool import PrefixCachePool


def test_takes_longest_whole_prefix_and_keeps_last_token_for_recompute():
    pool = PrefixCachePool(4)
    pool.put(np.array([1, 2, 3]), "a")
    pool.put(np.array([1, 2, 3, 4, 5]), "b")
    pool.put(np.array([9, 9]), "c")
    cache, n = pool.take(np.array([1, 2, 3, 4, 5, 6]))
    assert (cache, n) == ("b", 5)
    cache, n = pool.take(np.array([1, 2, 3]))  # "b" was taken; "a" matches fully but the last token is recomputed
    assert (cache, n) == ("a", 2)
    assert pool.take(np.array([7])) == (None, 0)


def test_the_longest_common_prefix_is_reused_even_when_the_entry_goes_on_differently():
    """A draft's entry ends with its proposals; after a rejection only the accepted part is shared."""
    pool = PrefixCachePool(4)
    pool.put(np.array([1, 2, 3, 4]), "other continuation")
    pool.put(np.array([1, 2, 7]), "shorter match")
    assert pool.take(np.array([1, 2, 3, 9, 9])) == ("other continuation", 3)
    assert pool.take(np.array([5, 5])) == (None, 0)
    assert len(pool) == 1


def test_bounded_with_lru_eviction():
    pool = PrefixCachePool(2)
    for i in range(3):
        pool.put(np.array([i, i]), str(i))
    assert len(pool) == 2
    assert pool.take(np.array([0, 0, 1])) == (None, 0)  # oldest evicted
    assert pool.take(np.array([2, 2, 1]))[0] == "2"


def test_capacity_zero_disables_reuse():
    pool = PrefixCachePool(0)
    pool.put(np.array([1, 2]), "a")
    assert pool.take(np.array([1, 2, 3])) == (None, 0)


def test_cached_tokens_counts_what_the_pool_holds():
    pool = PrefixCachePool(2)
    assert pool.cached_tokens == 0
    pool.put(np.array([1, 2, 3]), "a")
    pool.put(np.array([4, 5]), "b")
    assert pool.cached_tokens == 5
    pool.take(np.array([1, 2, 3, 4]))  # a sequence's entry leaves the pool while the engine works on it
    assert pool.cached_tokens == 2
    pool.put(np.array([7] * 10), "c")
    pool.put(np.array([8] * 10), "d")  # "b" evicted
    assert (len(pool), pool.cached_tokens) == (2, 20)


def copy_of(cache, length):
    return ("copy", cache, length)


def test_an_entry_past_a_shared_preamble_is_another_sequence_and_stays():
    """Two prompts that share a preamble: the second reuses a copy of it, and the
    first keeps its whole cache for its next call."""
    pool = PrefixCachePool(4, tail=2, copy_prefix=copy_of)
    pool.put(np.array([1, 2, 3, 4, 5, 6]), "first prompt and its tokens")
    assert pool.take(np.array([1, 2, 8, 9])) == (("copy", "first prompt and its tokens", 2), 2)
    assert pool.take(np.array([1, 2, 3, 4, 5, 6, 7])) == ("first prompt and its tokens", 6)
    assert len(pool) == 0


def test_an_entry_that_ends_with_rejected_drafts_is_the_same_sequence_and_is_taken():
    pool = PrefixCachePool(4, tail=2, copy_prefix=copy_of)
    pool.put(np.array([1, 2, 3, 4, 5]), "drafts 4 and 5 rejected")
    assert pool.take(np.array([1, 2, 3, 7])) == ("drafts 4 and 5 rejected", 3)
    assert len(pool) == 0


def test_a_kept_entry_counts_as_recently_used():
    pool = PrefixCachePool(2, tail=0, copy_prefix=copy_of)
    pool.put(np.array([1, 2, 3]), "a")
    pool.put(np.array([4, 5, 6]), "b")
    pool.take(np.array([1, 9]))  # a copy of "a"'s first token; "a" stays, now the most recent
    pool.put(np.array([7, 8]), "c")  # "b" is evicted, not "a"
    assert pool.take(np.array([4, 5, 6, 0]))[0] is None
    assert pool.take(np.array([1, 2, 3, 0])) == ("a", 3)


def test_keeping_entries_needs_a_way_to_copy_them():
    with pytest.raises(ValueError, match="copy_prefix"):
        PrefixCachePool(2, tail=1)


def test_an_entry_computed_on_another_prompt_path_is_reused_only_where_both_paths_agree():
    """Positions below an entry's prompt_path went through the prompt's larger kernel
    calls (cpu_engine/prompt_blocks.py): a call whose path differs reuses at most
    the shorter path, past which its keys and values would be computed otherwise."""
    tokens = np.arange(1, 41)
    pool = PrefixCachePool(4, tail=4, copy_prefix=lambda cache, n: f"{cache}[:{n}]")
    pool.put(tokens, "a", prompt_path=32)
    assert pool.take(np.append(tokens, 7), prompt_path=32) == ("a", 40)  # its own next call: all of it
    pool.put(tokens, "a", prompt_path=32)
    assert pool.take(np.append(tokens, 7), prompt_path=16) == ("a[:16]", 16)
    assert pool.take(np.append(tokens, 7)) == (None, 0)  # a call without a prompt path: nothing below 32 agrees
    assert pool.take(np.append(tokens, 7), prompt_path=48) == ("a[:32]", 32)


def test_the_engine_says_how_far_two_prompt_paths_agree():
    """With a prompt's rest padded to a call of its own size, two paths agree only
    up to their whole blocks (PromptBlock.agreement): the pool asks, not assumes."""
    tokens = np.arange(1, 41)
    pool = PrefixCachePool(4, tail=4, copy_prefix=lambda cache, n: f"{cache}[:{n}]",
                           path_agreement=lambda one, other: min(one, other) // 16 * 16)
    pool.put(tokens, "a", prompt_path=39)
    assert pool.take(np.append(tokens, 7), prompt_path=39) == ("a", 40)  # the same path: all of it
    pool.put(tokens, "a", prompt_path=39)
    assert pool.take(np.append(tokens, 7), prompt_path=48) == ("a[:32]", 32)
