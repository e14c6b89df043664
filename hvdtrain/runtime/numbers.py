"""Whole numbers typed by a user: flags, hostfile fields, environment variables.

One rule everywhere: the digits 0-9 and nothing else (spaces around them are dropped). Not
a sign (`+4`), not Python's underscores (`1_000`), not another script's digits (`٣`, which
`int()` takes, or `²`, which `str.isdigit` takes and `int()` does not), not `4.0`::

    parser.add_argument("--epochs", type=whole_number_type("--epochs"))
    slots = decimal(text)                       # an int, or None: the caller words the error
    np = whole_number(text, "-np", maximum=MAX_PROCESSES, bound=True)

A mistake is one `HvdtrainError` naming the flag or field, what it received and what it
expects ("Invalid value for `-np`: received '+4'; expected a positive integer in the digits
0-9, e.g. -np 1."). No TensorFlow here: the launcher imports it.
"""

from hvdtrain.errors import invalid_value

__all__ = ["decimal", "whole_number", "whole_number_type"]

_DIGITS = frozenset("0123456789")
_SPACES = " \t\r\n\v\f"


def _plain(text):
    """`text` without the spaces around it when it is digits 0-9 only, else None."""
    if not isinstance(text, str):
        return None
    text = text.strip(_SPACES)
    return text if text and _DIGITS.issuperset(text) else None


def decimal(text):
    """The int that `text` writes in the digits 0-9 (spaces around them dropped), else None
    (pure). None too past Python's 4,300 digits (`int()` refuses to read more)."""
    plain = _plain(text)
    try:
        return None if plain is None else int(plain.lstrip("0") or "0")
    except ValueError:
        return None


def _expected(name, minimum, maximum, digits):
    if maximum is not None:
        what = f"an integer from {minimum} to {maximum}"
    elif minimum == 1:
        what = "a positive integer"
    else:
        what = f"an integer >= {minimum}"
    example = max(minimum, 1) if maximum is None else min(max(minimum, 1), maximum)
    shown = f"{name} {example}" if name.startswith("-") else f"{name}={example}"
    return f"{what}{' in the digits 0-9' if digits else ''}, e.g. {shown}"


def whole_number(value, name, minimum=1, maximum=None, *, bound=False, text=True):
    """`value` (an int, or with `text` a str of digits: `decimal`) as an int from `minimum`
    to `maximum` (pure).

    Args:
        value: what was given.
        name: the flag or field, as the user wrote it (`-np`, `SLURM_NTASKS`).
        minimum: the smallest value allowed.
        maximum: the largest value allowed, or None.
        bound: `maximum` is hvdtrain's guard against a typo (`-np 1000000`), not a limit
            of the thing itself; a larger value is refused saying so.
        text: take a str of digits; False: an int only (a value set in code).

    Raises:
        HvdtrainError: "Invalid value for `name`: received ...; expected ...", one line.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif text and isinstance(value, str):
        number = decimal(value)
    else:
        number = None
    huge = number is None and text and _plain(value) is not None  # past int()'s digits
    too_big = huge or (number is not None and maximum is not None and number > maximum)
    if bound and too_big and maximum is not None:
        raise invalid_value(name, value, f"at most {maximum} (hvdtrain's bound; a typo?)")
    if number is None or number < minimum or too_big:
        limit = None if bound else maximum
        digits = number is None and text and isinstance(value, str) and not huge
        raise invalid_value(name, value, _expected(name, minimum, limit, digits))
    return number


def whole_number_type(name, minimum=1, maximum=None, *, bound=False):
    """An argparse `type=` for flag `name`: `whole_number` of the flag's text. Its mistake is
    a `HvdtrainError` (argparse lets it through), printed as one line by the CLI edge."""

    def parse(text):
        return whole_number(text, name, minimum, maximum, bound=bound)

    parse.__name__ = "whole number"  # (argparse's name for the type, in its own messages)
    return parse
