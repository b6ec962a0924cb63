"""diutil.untrusted against inputs written out by hand: what a server reads from a peer."""
import pytest

from diutil.untrusted import BadMessage, integer, integers, json_object, number, text


@pytest.mark.parametrize("data, reason", [
    (b"[" * 20000, "nested deeper than 8"),
    (b'{"a": [[[[[[[[[1]]]]]]]]]}', "nested deeper than 8"),
    (b'{"a": NaN}', "NaN"), (b'{"a": -Infinity}', "-Infinity"), (b'{"a": 1e400}', "1e400"),
    (b'{"a": ' + b"9" * 5000 + b"}", "not JSON"), (b"\xff", "not JSON"), (b"[1]", "a JSON list"),
    (b'{"a": "' + b"x" * 100 + b'"}', "expected at most 64"),
])
def test_refused_headers_say_why(data, reason):
    with pytest.raises(BadMessage, match=reason):
        json_object(data, "header", 64 if b"x" * 100 in data else 1 << 20)


def test_fields_are_typed_ranged_and_null_means_absent():
    msg = json_object(b'{"i": 3, "b": true, "f": 0.5, "s": "ab", "n": null, "l": [1, 2, 2]}', "m", 1024)
    assert integer(msg, "i", 0, 3) == 3 and number(msg, "f", 0, 1) == 0.5 and text(msg, "s", 2) == "ab"
    assert integer(msg, "n", 0, 9, default=7) == 7 and integer(msg, "gone", 0, 9, default=None) is None
    for call, reason in [(lambda: integer(msg, "i", 0, 2), "'i' is 3"), (lambda: integer(msg, "b", 0, 9), "'b' is True"),
                         (lambda: integer(msg, "f", 0, 9), "'f' is 0.5"), (lambda: text(msg, "s", 1), "'s'"),
                         (lambda: integer(msg, "gone", 0, 9), "'gone' is missing"),
                         (lambda: integers(msg, "l", 0, 9, 3, distinct=True), "more than once"),
                         (lambda: integers(msg, "l", 0, 9, 2), "at most 2")]:
        with pytest.raises(BadMessage, match=reason):
            call()
    assert integers(msg, "l", 0, 9, 3) == [1, 2, 2]
