"""The README's demo command: ragged steps, a prefix-cache hit, attention checked against dense float64."""

import pytest

from cute_kv.__main__ import main


def test_demo_checks_attention_and_prints_layout(capsys):
    assert main(["demo", "--device", "cpu", "--layers", "2", "--check-layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "request e reuses 96 tokens (6 pages) of request c" in out
    assert "-> OK" in out
    assert "TMA page view (P,D,H,N)" in out


def test_default_pages_scale_with_page_size():
    from cute_kv.demo import pages_needed

    assert pages_needed(16) == 3 + 1 + 9 + 2 + 7  # a: 40, b: 3, c: 142, d: 18, e: 105 tokens
    assert pages_needed(128) == 1 + 1 + 2 + 1 + 1
    assert pages_needed(256) < pages_needed(64) < pages_needed(16)


@pytest.mark.parametrize("argv, message", [
    (["--check-layers", "2"], "--check-layers: layer 2 is outside the cache's 2 layers (use [-2, 2))"),
    (["--check-layers", "-3"], "layer -3 is outside"),
    (["--check-layers", "a"], "--check-layers must be comma-separated ints"),
    (["--pages", "5"], "--pages 5 is below the 22 pages the steps need at page size 16"),
    (["--page-size", "0"], "page_size"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--device", "cpu", "--layers", "2", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
