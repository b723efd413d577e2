"""Credentials in shard URLs (a password, a presigned URL's signature) never reach a log line or
an error message: every process logs through `setup_logging`'s formatters and `say`."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from dispatcher_server.cliopts import redact, say, setup_logging
from dispatcher_server.metrics import event

SECRETS = ("s3cr3t", "AKIAEXAMPLE", "deadbeef", "goog5ig", "azur3sig", "tok3n", "acc3ss")
URLS = [
    "http://alice:s3cr3t@data.example.com/shards/x-000.tar",
    "https://bucket.s3.amazonaws.com/x-000.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256"
    "&X-Amz-Credential=AKIAEXAMPLE%2F20250101%2Fus-east-1%2Fs3%2Faws4_request"
    "&X-Amz-Date=20250101T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host"
    "&X-Amz-Signature=deadbeef",
    "https://storage.googleapis.com/b/x-000.tar?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Signature=goog5ig",
    "https://acct.blob.core.windows.net/c/x-000.tar?sv=2022-11-02&se=2030-01-01&sp=r&sig=azur3sig%3D",
    "https://cdn.example.com/x-000.tar?token=tok3n&part=1",
    "https://cdn.example.com/x-000.tar?access_token=acc3ss",
]


@pytest.fixture
def logging_to_stderr():
    """`setup_logging` (which writes to the sys.stderr of its call, capsys's here), undone after."""
    root = logging.getLogger()
    before = list(root.handlers), root.level
    yield setup_logging
    for h in list(root.handlers):
        if h not in before[0]:
            root.removeHandler(h)
    root.setLevel(before[1])


def _no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, (secret, text)


@pytest.mark.parametrize("url", URLS)
def test_redact_hides_the_secret_and_keeps_the_rest(url):
    out = redact(url)
    _no_secret(out)
    assert "***" in out
    host = url.split("@")[-1] if "@" in url else url.split("://")[1]
    assert host.split("?")[0] in out  # where the shard is stays readable
    for name in ("X-Amz-Signature=", "X-Amz-Credential=", "X-Goog-Signature=", "sig=", "token="):
        assert (name in out) == (name in url)


def test_redact_leaves_lines_without_credentials_alone():
    for text in ("event=bound readers=tcp://127.0.0.1:5555 trainers=tcp://0.0.0.0:5556",
                 "shard=s3://bucket/x-000.tar key=abc sig=1 token=2",
                 "https://bob@host/x.tar?part=1&sv=2022", "no url at all: token=abc"):
        assert redact(text) == text


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_log_lines_of_both_formats_hide_credentials(log_format, logging_to_stderr, capsys):
    logging_to_stderr(log_format, "INFO")
    for url in URLS:
        event("shard_assigned", shard=url, pos=0, start=0)
        event("sample_skipped", logging.WARNING, shard=url, reason="open_failed", count=1)
    try:
        raise OSError(f"cannot open: shard {URLS[0]!r}: failed 5 times")
    except OSError:
        logging.getLogger("mmdispatch.pipeline").exception("skipped %s", URLS[1])
    err = capsys.readouterr().err
    _no_secret(err)
    lines = err.strip().splitlines() if log_format == "text" else \
        [json.loads(line) for line in err.strip().splitlines()]
    assert len([x for x in lines if "shard_assigned" in str(x)]) == len(URLS)
    if log_format == "json":
        assigned = [x for x in lines if x.get("event") == "shard_assigned"]
        assert assigned[0]["shard"] == "http://alice:***@data.example.com/shards/x-000.tar"
        assert "alice:***@" in next(x for x in lines if "exception" in x)["exception"]
    else:
        assert "shard=http://alice:***@data.example.com/shards/x-000.tar" in err


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_say_hides_credentials(log_format, capsys):
    say(f"mmdispatch read: error: cannot open {URLS[1]}", log_format)
    err = capsys.readouterr().err
    _no_secret(err)
    assert "X-Amz-Signature=***" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_command_error_for_a_url_with_a_password_hides_it(log_format):
    url = "http://alice:s3cr3t@127.0.0.1:9/x-*.tar?X-Amz-Signature=deadbeef"
    run = subprocess.run([sys.executable, "-m", "mmdispatch.cli", "serve", "--shards", url,
                          "--world-size", "2", "--global-batch", "4", "--log-format", log_format],
                         capture_output=True, text=True, timeout=50)
    assert run.returncode == 2, run.stderr
    _no_secret(run.stderr)
    assert "alice:***@127.0.0.1:9" in run.stderr and "Traceback" not in run.stderr


def test_json_log_fields_are_numbers_where_they_are_numbers():
    """Every field was a string ("step": "17"): a collector could not compare or sum them.
    Names stay strings even when all digits (a key "123"): collectors type a field once."""
    import json

    from dispatcher_server.cliopts import JsonFormatter

    record = logging.LogRecord("mmdispatch", logging.INFO, __file__, 1,
                               "mmdispatch event=step_planned step=17 plan_ms=0.42 lb_ratio=1.000 "
                               "keys=123 name=0 shard='/d/0.tar' detail='12'", (), None)
    out = json.loads(JsonFormatter().format(record))
    assert (out["step"], out["plan_ms"], out["lb_ratio"]) == (17, 0.42, 1.0)
    assert (out["keys"], out["name"], out["shard"], out["detail"]) == ("123", "0", "/d/0.tar", "12")


def test_a_library_warning_is_one_json_line_like_every_other():
    """Probe: Pillow's DecompressionBombWarning reached a --log-format json stream as two raw
    lines (the warning and `warnings.warn(`)."""
    code = ("from dispatcher_server.cliopts import setup_logging; setup_logging('json'); "
            "import warnings; warnings.warn('image size exceeds the limit', UserWarning)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = run.stderr.splitlines()
    assert run.returncode == 0 and lines, run.stderr
    records = [json.loads(line) for line in lines]  # every line one JSON object
    assert [(r["logger"], r["level"]) for r in records] == [("py.warnings", "WARNING")]
    assert "image size exceeds the limit" in records[0]["message"]


def test_pending_skips_are_said_once_due_without_another_skip():
    """Probe: skips after the first of each reason went unsaid until the reader's next skip
    or its exit; a reader that stays up never said them."""
    from pipeline.errors import SkipDigest

    now = [0.0]
    digest = SkipDigest(every_s=10.0, clock=lambda: now[0])
    said = []
    digest.flush = lambda real=digest.flush: said.append(real())
    digest.note("too_long", "a.tar")
    digest.flush_due()
    assert said == []  # not due yet
    now[0] = 10.5
    digest.flush_due()
    assert len(said) == 1 and "count=1" in said[0] and "too_long=1" in said[0]
    digest.flush_due()
    assert len(said) == 1  # nothing pending: nothing said
