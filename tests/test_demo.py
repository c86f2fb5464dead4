"""The README's demo command: ragged steps, a prefix-cache hit, attention checked against dense float64."""

from cute_kv.__main__ import main


def test_demo_checks_attention_and_prints_layout(capsys):
    assert main(["demo", "--device", "cpu", "--layers", "2", "--check-layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "request e reuses 96 tokens (6 pages) of request c" in out
    assert "-> OK" in out
    assert "TMA page view (P,D,H,N)" in out
