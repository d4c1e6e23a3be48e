"""What must never reach a result row or a log line written by raybench: secret values and terminal colours."""

from __future__ import annotations

import os
import re

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
SECRET_PATTERN = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
# Names that look secret but hold a setting: Ray's auth mode is "token" in every embedded run, and replacing that
# word would garble every message that says "tokenizer" or "tokens".
NOT_SECRET = frozenset({"RAY_AUTH_MODE"})


def without_secrets(text: str, environ: dict[str, str] | None = None) -> str:
    """`text` with the value of every secret-looking environment variable (TOKEN, KEY, ...) replaced."""
    environ = os.environ if environ is None else environ
    for name, value in environ.items():
        # values shorter than 4 characters would match ordinary text
        if SECRET_PATTERN.search(name) and name not in NOT_SECRET and len(value) >= 4:
            text = text.replace(value, f"<{name} redacted>")
    return text
