"""Whole numbers a user types (`hvdtrain.runtime.numbers`): the digits 0-9 and nothing else,
in every flag, hostfile field and environment variable that takes one."""

import argparse

import pytest

from hvdtrain.errors import HvdtrainError
from hvdtrain.runtime.numbers import decimal, whole_number, whole_number_type

HUGE = "9" * 30
PAST_INT = "9" * 5000  # past int()'s 4,300 digits


@pytest.mark.parametrize(
    "text, value",
    [
        ("4", 4),
        ("+4", None),  # a sign
        ("1_000", None),  # Python's separators
        ("٣", None),  # Arabic-Indic three: int() takes it
        ("²", None),  # str.isdigit() takes it, int() does not
        ("0", 0),
        ("-1", None),
        (" 4 ", 4),  # spaces around it are dropped
        ("4\n", 4),
        ("4 2", None),
        ("4.0", None),
        ("", None),
        (" ", None),
        ("0x10", None),
        ("\u20284", None),  # a line break that is not ASCII
        (HUGE, int(HUGE)),
        ("0" * 5000 + "7", 7),
        (PAST_INT, None),
        (4, None),  # text only
        (None, None),
    ],
)
def test_only_the_digits_0_to_9_are_a_number(text, value):
    assert decimal(text) == value


@pytest.mark.parametrize(
    "text, options, expected",
    [
        ("4", {}, 4),
        (" 4 ", {}, 4),
        ("1", {}, 1),
        ("0", {"minimum": 0}, 0),
        (HUGE, {}, int(HUGE)),
        ("65536", {"maximum": 65536, "bound": True}, 65536),
        ("+4", {}, "received '+4'; expected a positive integer in the digits 0-9, e.g. -n 1."),
        ("1_000", {}, "received '1_000'; expected a positive integer in the digits 0-9"),
        ("٣", {}, "received '٣'; expected a positive integer in the digits 0-9"),
        ("0", {}, "received '0'; expected a positive integer, e.g. -n 1."),
        ("-1", {}, "received '-1'; expected a positive integer in the digits 0-9"),
        ("-1", {"minimum": 0}, "received '-1'; expected an integer >= 0 in the digits 0-9"),
        ("4.0", {}, "received '4.0'; expected a positive integer in the digits 0-9"),
        ("", {}, "received ''; expected a positive integer in the digits 0-9"),
        ("2", {"minimum": 3}, "received '2'; expected an integer >= 3, e.g. -n 3."),
        ("9", {"maximum": 8}, "received '9'; expected an integer from 1 to 8, e.g. -n 1."),
        (HUGE, {"maximum": 8}, "expected an integer from 1 to 8, e.g. -n 1."),
        (HUGE, {"maximum": 8, "bound": True}, "expected at most 8 (hvdtrain's bound; a typo?)."),
        (PAST_INT, {"maximum": 8, "bound": True}, "expected at most 8 (hvdtrain's bound"),
        ("0", {"maximum": 8, "bound": True}, "received '0'; expected a positive integer, e.g."),
    ],
)
def test_a_flag_takes_a_whole_number_in_its_range(text, options, expected):
    if isinstance(expected, int):
        assert whole_number(text, "-n", **options) == expected
        return
    with pytest.raises(HvdtrainError) as refused:
        whole_number(text, "-n", **options)
    message = str(refused.value)
    assert message.startswith("Invalid value for `-n`: received ") and "\n" not in message
    assert expected in message


def test_a_value_set_in_code_is_an_int():
    assert whole_number(4, "--epochs") == 4
    for value in (True, 4.0, "4", None):
        with pytest.raises(HvdtrainError, match=r"received .*; expected a positive integer, e"):
            whole_number(value, "--epochs", text=False)
    with pytest.raises(HvdtrainError, match="`--epochs`: received 0;"):
        whole_number(0, "--epochs")


def test_a_field_that_is_no_flag_is_shown_as_a_variable():
    with pytest.raises(HvdtrainError, match="expected a positive integer, e.g. SLURM_NTASKS=1"):
        whole_number("0", "SLURM_NTASKS")


def test_argparse_takes_it_as_a_type_and_lets_its_one_line_through():
    p = argparse.ArgumentParser()
    p.add_argument("-np", type=whole_number_type("-np", maximum=64, bound=True), default="2")
    assert p.parse_args([]).np == 2  # a default given as text is read too
    assert p.parse_args(["-np", "8"]).np == 8
    with pytest.raises(HvdtrainError, match=r"^Invalid value for `-np`: received '\+8'; expect"):
        p.parse_args(["-np", "+8"])
    with pytest.raises(HvdtrainError, match="at most 64 .hvdtrain's bound"):
        p.parse_args(["-np", "65"])
