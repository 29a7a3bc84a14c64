"""`tokenbus proxy`'s configuration and command line, and what it imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenbus.api.proxy.config import ProxyConfig
from tokenbus.api.proxy.router import prefill_body
from tokenbus.cli.main import build_parser
from tokenbus.cli.proxy_cmd import config_from

# ---------------------------------------------------------------------------------------------
# Configuration and CLI


def test_prefill_body_keeps_everything_else():
    body = {
        "model": "m",
        "prompt": "p",
        "max_tokens": 50,
        "stream": True,
        "n": 3,
        "stop": ["\n"],
        "stream_options": {"include_usage": True},
        "kv_transfer_params": {"stale": 1},
    }
    assert prefill_body(body) == {
        "model": "m",
        "prompt": "p",
        "max_tokens": 1,
        "stream": False,
        "n": 1,
        "stop": ["\n"],
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert body["max_tokens"] == 50  # the client's body is left alone


def test_cli_parses_into_a_config():
    ns = build_parser().parse_args(
        [
            "proxy",
            "--prefill",
            "http://p:1/",
            "https://p:2",
            "--decode",
            "http://d:3",
            "--port",
            "0",
            "--request-timeout",
            "30",
            "--prefill-timeout",
            "4.5",
            "--decode-timeout",
            "0",
        ]
    )
    config = config_from(ns)
    assert config.prefill_urls == ("http://p:1", "https://p:2") and config.decode_urls == (
        "http://d:3",
    )
    assert config.port == 0 and config.request_timeout == 30 and config.host == "127.0.0.1"
    assert config.prefill_timeout == 4.5 and config.decode_timeout is None  # 0: no limit
    defaults = config_from(
        build_parser().parse_args(
            ["proxy", "--prefill", "http://p", "--decode", "http://d", "--port", "1"]
        )
    )
    assert defaults.prefill_timeout == 10 and defaults.decode_timeout == 600


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--prefill", "http://p:1", "--port", "1"], "--decode"),
        (["--prefill", "http://p:1", "--decode", "localhost:8100", "--port", "1"], "--decode"),
        (["--prefill", "p:1", "--decode", "http://d:1", "--port", "1"], "--prefill"),
    ],
)
def test_cli_rejects_bad_flags(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["proxy", *argv])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"decode_urls \(--decode\): at least one"):
        ProxyConfig(prefill_urls=("http://p:1",), decode_urls=())
    with pytest.raises(ValueError, match=r"prefill_urls \(--prefill\): 'ftp://p' is not an http"):
        ProxyConfig(prefill_urls=("ftp://p",), decode_urls=("http://d:1",))
    with pytest.raises(ValueError, match=r"decode_urls \(--decode\): a URL is listed twice"):
        ProxyConfig(prefill_urls=(), decode_urls=("http://d:1", "http://d:1/"))
    with pytest.raises(ValueError, match="request_timeout"):
        ProxyConfig(prefill_urls=(), decode_urls=("http://d:1",), request_timeout=0)
    for name, value in [
        ("prefill_timeout", 0),
        ("prefill_timeout", float("inf")),
        ("prefill_timeout", float("nan")),
        ("decode_timeout", -1),
    ]:
        with pytest.raises(ValueError, match=f"{name}: must be a finite number > 0"):
            ProxyConfig(prefill_urls=(), decode_urls=("http://d:1",), **{name: value})


def test_cli_bad_timeout_is_a_message_not_a_traceback():
    argv = ["proxy", "--prefill", "http://p:1", "--decode", "http://d:1", "--port", "0"]
    result = subprocess.run(
        [sys.executable, "-m", "tokenbus", *argv, "--prefill-timeout", "-2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "prefill_timeout: must be a finite number > 0 seconds, got -2" in result.stderr


def test_proxy_imports_no_torch_and_no_engine():
    code = (
        "import sys, tokenbus.api.proxy.app, tokenbus.cli.proxy_cmd; "
        "bad = [m for m in sys.modules "
        "       if m == 'torch' or m.startswith(('tokenbus.engine', 'tokenbus.api.openai'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
