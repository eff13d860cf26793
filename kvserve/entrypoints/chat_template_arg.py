"""`kvserve serve --chat-template`, as vLLM takes it: a file's path, or the Jinja template itself
(a value with a brace or a newline). Read and compiled while the arguments are parsed, so a
missing file or a template with a syntax error stops the command before the model loads."""

from __future__ import annotations

import argparse
import os

_JINJA_CHARS = "{}\n"  # vLLM's test for an inline template


def chat_template(text: str) -> str:
    """The template's text; argparse's error names the file or the template's syntax error."""
    path = os.path.expanduser(text)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise argparse.ArgumentTypeError(f"{text!r}: cannot read it: {why}") from None
    elif any(c in text for c in _JINJA_CHARS):
        template = text
    else:
        what = "is a directory" if os.path.isdir(path) else "no such file"
        raise argparse.ArgumentTypeError(f"{text!r}: {what} (nor a Jinja template: it has no {{ }})")
    if not template.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: the template is empty")
    check_syntax(template)
    return template


def check_syntax(template: str) -> None:
    """Compiled with the environment transformers renders chat templates in (sandboxed, with
    loop controls), so a template that fails here would fail every chat request."""
    from jinja2 import TemplateSyntaxError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=[loopcontrols]).parse(template)
    except TemplateSyntaxError as e:
        why = f"not a valid Jinja template: {e.message} (line {e.lineno})"
        raise argparse.ArgumentTypeError(why) from None
