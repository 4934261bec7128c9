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
