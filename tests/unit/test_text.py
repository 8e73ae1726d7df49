from coordinator.response.text import CompletionText

CHARS = {i: c for i, c in enumerate("abcdefghijklmnopqrstuvwxyz \n")}


def decode(ids):
    return "".join(CHARS[i] if i in CHARS else "\ufffd" for i in ids)


def ids(text):
    reverse = {c: i for i, c in CHARS.items()}
    return [reverse[c] for c in text]


def test_deltas_concatenate_to_the_full_text():
    text = CompletionText(decode)
    deltas = [text.append(ids("hel")), text.append(ids("lo wo")), text.append(ids("rld"), final=True)]
    assert "".join(deltas) == "hello world"


def test_incomplete_utf8_is_held_back_until_complete():
    text = CompletionText(decode)
    assert text.append([0, 99]) == "a"  # 99 decodes to a replacement char: held
    assert text.append([1], final=True) == "\ufffdb"


def test_stop_word_ends_text_and_is_not_emitted_even_across_rounds():
    text = CompletionText(decode, ["\n\nd"])
    out = text.append(ids("abc\n"))
    assert out == "abc"  # "\n" could begin the stop word: held back
    out += text.append(ids("\nde"))
    assert text.stopped and out == "abc"


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop_word():
    text = CompletionText(decode, ["xyz"])
    assert text.append(ids("abx")) == "ab"
    assert text.append(ids("a")) == "xa"
    assert not text.stopped
