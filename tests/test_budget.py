import psutil
import pytest

from tierstore.budget import parse_bytes, rows_for_budget


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4096", 4096),
        ("64MiB", 64 * 2**20),
        ("2GiB", 2 * 2**30),
        ("1.5 KB", 1500),
        ("3mb", 3 * 10**6),
    ],
)
def test_parse_bytes_units(text, expected):
    assert parse_bytes(text) == expected


def test_percent_is_share_of_total_memory():
    assert parse_bytes("10%", total_memory=1000) == 100
    assert parse_bytes("50%") == psutil.virtual_memory().total // 2


@pytest.mark.parametrize("text", ["lots", "12 parsecs", "150%", ""])
def test_bad_budget_text_is_a_clear_error(text):
    with pytest.raises(ValueError, match="budget"):
        parse_bytes(text)


def test_rows_for_budget_is_the_largest_count_that_fits():
    def cost(rows):
        return rows * 100 + 24

    assert rows_for_budget("1024", cost) == 10
    assert rows_for_budget("1KiB", cost) == 10
    assert rows_for_budget(123, cost) == 123  # an int is a row count
    assert rows_for_budget(None, cost) == 0


@pytest.mark.parametrize("budget", [-1, 1.5, True])
def test_bad_budget_type_or_sign(budget):
    with pytest.raises((TypeError, ValueError)):
        rows_for_budget(budget, lambda rows: rows)
