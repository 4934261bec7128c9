from hypothesis import given, settings
from hypothesis import strategies as st

from engine.textstream import TextStream


def feed(stream: TextStream, pieces: list[bytes]) -> str:
    return "".join(stream.push(p) for p in pieces)


def test_text_passes_through_without_stop_strings():
    s = TextStream([])
    assert feed(s, [b"Hel", b"lo"]) + s.flush() == "Hello"


def test_stop_string_split_across_pieces_is_never_emitted():
    s = TextStream(["STOP"])
    out = [s.push(p) for p in [b"abc S", b"TO", b"P tail"]]
    assert out == ["abc ", "", ""] and s.stopped and s.flush() == ""


def test_held_text_is_released_when_it_is_not_a_stop():
    s = TextStream(["STOP"])
    assert s.push(b"xST") == "x"
    assert s.push(b"ay") == "STay"


def test_earliest_of_several_stops_wins():
    s = TextStream(["world", "lo w"])
    assert s.push(b"hello world") == "hel" and s.stopped


def test_multibyte_character_split_across_tokens():
    s = TextStream([])
    data = "né😀".encode()
    assert feed(s, [data[i:i + 1] for i in range(len(data))]) + s.flush() == "né😀"


def test_flush_releases_a_partial_stop_at_the_end():
    s = TextStream(["</end>"])
    assert s.push(b"done </e") == "done " and s.flush() == "</e"


def test_a_stop_string_inside_a_longer_ones_prefix_ends_the_text():
    s = TextStream(["abcd", "bc"])
    assert s.push(b"xab") == "x" and s.push(b"c") == "a" and s.stop_string == "bc"


def test_many_stop_strings_end_at_the_first_one_generated():
    stops = [f"never{i}" for i in range(10_000)] + ["end"]
    s = TextStream(stops)
    assert feed(s, [b"the ", b"ne", b"ver ", b"e", b"nd", b" more"]) == "the never " \
        and s.stop_string == "end"


def _reference(stop: list[str], pieces: list[bytes]) -> tuple[str, bool]:
    """What a stream emits, computed the plain way: each piece's text with the held text
    before it, searched for every stop string; held back, the longest end of the text that
    begins one."""
    import codecs
    stop = [s for s in stop if s]
    decoder, held, out = codecs.getincrementaldecoder("utf-8")(errors="replace"), "", ""
    for piece in pieces:
        text = held + decoder.decode(piece)
        found = [i for s in stop if (i := text.find(s)) >= 0]
        if found:
            return out + text[:min(found)], True
        keep = max((k for s in stop for k in range(1, min(len(s) - 1, len(text)) + 1)
                    if text.endswith(s[:k])), default=0)
        held = text[len(text) - keep:]
        out += text[:len(text) - keep]
    return out + held + decoder.decode(b"", final=True), False


@settings(max_examples=500, deadline=None)
@given(stop=st.lists(st.text("abc", max_size=4), max_size=5),
       text=st.text("abcé", max_size=24), cuts=st.lists(st.integers(0, 40), max_size=8))
def test_the_automaton_emits_what_searching_every_stop_string_does(stop, text, cuts):
    data = text.encode()
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    pieces = [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    s = TextStream(stop)
    emitted = feed(s, pieces)
    emitted += s.flush()
    assert (emitted, s.stopped) == _reference(stop, pieces)
    if s.stopped:
        assert text.startswith(emitted + s.stop_string)
