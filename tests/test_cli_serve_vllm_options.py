"""`kvserve serve` options vLLM users pass (--chat-template, --disable-log-requests,
--uvicorn-log-level, --tokenizer, --trust-remote-code): each was "unrecognized arguments"."""

from __future__ import annotations

import httpx
import pytest
from server_utils import ServerProcess

from kvserve.entrypoints.cli import build_parser, main

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}ANSWER:"


def _serve_args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert _serve_args("--chat-template", str(path)).chat_template == TEMPLATE
    assert _serve_args("--chat-template", TEMPLATE).chat_template == TEMPLATE
    assert _serve_args().chat_template is None


@pytest.mark.parametrize(
    "value, message",
    [
        ("no-such.jinja", "'no-such.jinja': no such file (nor a Jinja template: it has no { })"),
        ("{% for m in messages %}", "not a valid Jinja template: Unexpected end of template."),
    ],
)
def test_a_bad_chat_template_stops_serve_at_parse(value, message, capsys):
    with pytest.raises(SystemExit) as e:
        _serve_args("--chat-template", value)
    assert e.value.code == 2
    assert f"argument --chat-template: {message}" in capsys.readouterr().err


OTHER_TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}|{{ m['content'] }}>>{% endfor %}REPLY:"


@pytest.fixture(scope="module")
def other_tokenizer_dir(tiny_llama_dir, tmp_path_factory) -> str:
    """The tiny model's tokenizer saved alone (no config.json, no weights) with another chat
    template and one added token, so both show whose tokenizer is in use."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.chat_template = OTHER_TEMPLATE
    tok.add_tokens(["<|mark|>"])
    path = str(tmp_path_factory.mktemp("other-tokenizer"))
    tok.save_pretrained(path)
    return path


def test_offline_llm_uses_another_tokenizer_and_its_template(tiny_llama_dir, other_tokenizer_dir):
    """LLM(tokenizer=DIR) was a ValueError ("only the model's own tokenizer"); vLLM loads the
    tokenizer, chat template included, from DIR. The engine core uses it too (its eos)."""
    from kvserve import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, tokenizer=other_tokenizer_dir, kv_cache_memory="4MiB", max_model_len=128)
    messages = [{"role": "user", "content": "hi <|mark|>"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.prompt == "<<user|hi <|mark|>>>REPLY:"
    mark = llm.get_tokenizer().convert_tokens_to_ids("<|mark|>")
    assert mark in out.prompt_token_ids and llm.llm_engine.core.tokenizer.hf.chat_template == OTHER_TEMPLATE


def test_a_tokenizer_larger_than_the_model_s_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    """Ids past the embedding rows would index past them: refused naming the option."""
    from transformers import AutoTokenizer

    from kvserve import LLM

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.add_tokens([f"<extra{i}>" for i in range(200)])  # ~600 tokens, the model has 512 rows
    tok.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"^tokenizer: .* more than the model's 512 embedding rows"):
        LLM(tiny_llama_dir, tokenizer=str(tmp_path), kv_cache_memory="4MiB")
    with pytest.raises(FileNotFoundError, match=r"^tokenizer: .* nor a \.gguf file"):
        LLM(tiny_llama_dir, tokenizer=str(tmp_path / "missing"))


def test_tokenizer_naming_the_model_is_its_own(tmp_path):
    """--tokenizer MODEL (vLLM's scripts pass it) is the model's own: dropped before the engine,
    so --engine naive takes it and refuses another."""
    from kvserve.entrypoints.cli import _naive_options, _vllm_only_options

    model = str(tmp_path)
    args = _serve_args(model, "--tokenizer", model + "/", "--engine", "naive")
    assert _vllm_only_options(args) is None and args.tokenizer is None and _naive_options(args) is None
    args = _serve_args(model, "--tokenizer", "/other", "--engine", "naive")
    assert _vllm_only_options(args) is None and _naive_options(args).startswith("tokenizer: not used")


def test_vllm_s_benchmark_server_command_is_taken():
    """vLLM's benchmark instructions start its server with `--swap-space 16
    --disable-log-requests`: "unrecognized arguments"; so were --disable-log-stats,
    --enable-chunked-prefill, --load-format auto, --download-dir, --max-seq-len-to-capture."""
    from kvserve.entrypoints.cli import engine_config
    from kvserve.entrypoints.serve_vllm_options import vllm_only_problem

    args = _serve_args("--swap-space", "16", "--disable-log-requests", "--disable-log-stats",
                       "--enable-chunked-prefill", "--load-format", "auto", "--tokenizer-mode", "auto",
                       "--download-dir", "/tmp", "--max-seq-len-to-capture", "8192")  # fmt: skip
    assert vllm_only_problem(args) is None and engine_config(args) == engine_config(_serve_args())


def test_vllm_s_tool_calling_server_command_is_taken():
    """`vllm serve MODEL --enable-auto-tool-choice --tool-call-parser hermes` (vLLM's recipe for
    tool calls) was "unrecognized arguments"; kvserve always reads hermes and llama3_json calls."""
    from kvserve.entrypoints.cli import engine_config
    from kvserve.entrypoints.serve_vllm_options import vllm_only_problem

    for parser in ("hermes", "llama3_json"):
        args = _serve_args("--enable-auto-tool-choice", "--tool-call-parser", parser)
        assert vllm_only_problem(args) is None and engine_config(args) == engine_config(_serve_args())


def test_vllm_s_task_and_runner_are_taken_for_what_kvserve_serves():
    """`--task generate` / `--task embed` / `--runner pooling` (vLLM's recipes) were
    "unrecognized arguments"; one kvserve server answers both generation and /v1/embeddings."""
    from kvserve.entrypoints.cli import engine_config
    from kvserve.entrypoints.serve_vllm_options import vllm_only_problem

    taken = (("task", "generate"), ("task", "embed"), ("task", "embedding"), ("runner", "pooling"))
    for flag, value in taken:
        args = _serve_args(f"--{flag}", value)
        assert vllm_only_problem(args) is None and engine_config(args) == engine_config(_serve_args())


def test_vllm_serve_flags_for_what_kvserve_always_does_are_taken():
    """--response-role assistant, --enable-prompt-tokens-details, --enable-log-requests,
    --max-log-len N, --guided-decoding-backend xgrammar, --api-server-count 1 were "unrecognized
    arguments"; another role, backend or count is refused naming the flag."""
    from kvserve.entrypoints.serve_vllm_options import vllm_only_problem

    flags = ["--response-role", "assistant", "--enable-prompt-tokens-details", "--enable-log-requests"]
    flags += ["--max-log-len", "100", "--guided-decoding-backend", "xgrammar", "--api-server-count", "1"]
    args = _serve_args(*flags)
    assert vllm_only_problem(args) is None
    for flags, said in [
        (("--response-role", "user"), "response-role: 'user' is not supported; a chat reply's role"),
        (("--guided-decoding-backend", "outlines"), "guided-decoding-backend: 'outlines' is not supported"),
        (("--api-server-count", "4"), "api-server-count: '4' is not supported; a server runs one API"),
    ]:
        assert vllm_only_problem(_serve_args(*flags)).startswith(said)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--task", "classify"], "task: 'classify' is not supported; kvserve serves generation and "),
        (["--reasoning-parser", "qwen3"], "reasoning-parser: 'qwen3' is not supported; kvserve does not"),
        (["--tool-call-parser", "mistral"], "tool-call-parser: 'mistral' is not supported; kvserve reads"),
        (["--no-enable-auto-tool-choice"], "enable-auto-tool-choice: --no-enable-auto-tool-choice is not"),
        (["--revision", "main"], "revision: 'main' is not supported; a model revision is not supported"),
        (["--no-enable-chunked-prefill"], "enable-chunked-prefill: --no-enable-chunked-prefill is not"),
        (["--load-format", "pt"], "load-format: 'pt' is not supported; weights load from safetensors"),
        (["--tokenizer-mode", "slow"], "tokenizer-mode: 'slow' is not supported"),
    ],
)  # fmt: skip
def test_a_vllm_option_kvserve_cannot_honour_is_refused_before_the_model_loads(
    flags, message, tmp_path, capsys
):
    assert main(["serve", str(tmp_path / "model"), *flags]) == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")


def test_max_logprobs_is_checked_at_parse():
    """vLLM's --max-logprobs was "unrecognized arguments"; -1 (the vocabulary) is its lowest."""
    assert _serve_args().max_logprobs == 20 and _serve_args("--max-logprobs", "-1").max_logprobs == -1
    with pytest.raises(SystemExit):
        _serve_args("--max-logprobs", "-2")


def _max_logprobs_hold(httpx, url: str) -> None:
    """--max-logprobs 30: 25 alternatives are more than OpenAI's 20, taken; 31 a 400 naming the field.
    (Completions' top_logprobs is keyed by token: by id, as two tokens may read the same.)"""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
    r = httpx.post(
        f"{url}/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 25}, timeout=60
    )
    assert (
        r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25
    )
    done = {"prompt": "hi", "max_tokens": 1, "temperature": 0}
    r = httpx.post(
        f"{url}/v1/completions",
        json={**done, "logprobs": 30, "prompt_logprobs": 30, "return_tokens_as_token_ids": True},
        timeout=60,
    )
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 30, r.text
    for path, body, field in [
        ("chat/completions", {**chat, "logprobs": True, "top_logprobs": 31}, "top_logprobs"),
        ("completions", {**done, "logprobs": 31}, "logprobs"),
        ("completions", {**done, "prompt_logprobs": 31}, "prompt_logprobs"),
    ]:
        r = httpx.post(f"{url}/v1/{path}", json=body, timeout=60)
        err = r.json()["error"]
        assert (
            r.status_code == 400
            and err["param"] == field
            and "(30; serve's --max-logprobs)" in err["message"]
        )


def _self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_path), str(key_path)


def test_tls_files_are_checked_before_the_model_loads(tmp_path, capsys):
    """A key without its certificate, or a certificate that is no certificate, was found by
    uvicorn once the model had loaded (vLLM's flags were "unrecognized arguments" here)."""
    cert, key = _self_signed(tmp_path)
    model = str(tmp_path / "model")
    assert main(["serve", model, "--ssl-keyfile", key]) == 2
    assert capsys.readouterr().err.startswith("error: ssl-keyfile: needs --ssl-certfile")
    assert main(["serve", model, "--ssl-certfile", key, "--ssl-keyfile", cert]) == 2
    assert capsys.readouterr().err.startswith(f"error: ssl-certfile: cannot serve TLS with {key!r}")
    with pytest.raises(SystemExit):
        _serve_args("--root-path", "api")  # no leading /
    assert _serve_args("--root-path", "/api/").root_path == "/api"


def test_the_options_work_on_a_running_server(tiny_llama_dir, other_tokenizer_dir, tmp_path):
    """The template really renders the prompt (over --tokenizer's own, as vLLM's); --tokenizer
    DIR tokenizes (its added token is one id) and --trust-remote-code is taken (said to change
    nothing); --disable-log-requests drops the per-request log line, --uvicorn-log-level reaches
    uvicorn (info: its access log); --max-logprobs moves the cap on alternatives. HTTPS with
    --ssl-certfile / --ssl-keyfile; --root-path /api: the paths a proxy keeps it on reach the
    routes, and the API-key gate still guards them."""
    import ssl

    log = tmp_path / "serve.log"
    cert, key = _self_signed(tmp_path)
    s = ServerProcess(
        tiny_llama_dir, "--kv-cache-memory", "4MiB", "--chat-template", TEMPLATE,
        "--tokenizer", other_tokenizer_dir, "--trust-remote-code", "--disable-log-requests",
        "--uvicorn-log-level", "info", "--max-logprobs", "30", "--ssl-certfile", cert, "--ssl-keyfile", key,
        "--root-path", "/api", api_key="k", log_path=str(log),
    )  # fmt: skip
    assert s.url.startswith("https://")
    tls = ssl.create_default_context(cafile=cert)
    try:
        with httpx.Client(verify=tls, headers=s.headers, timeout=60) as api:
            _max_logprobs_hold(api, s.url)
            assert api.get(f"{s.url}/api/v1/models").status_code == 200
            assert httpx.get(f"{s.url}/api/v1/models", verify=tls).status_code == 401  # no key
            assert api.get(f"{s.url}/openapi.json").json()["servers"] == [{"url": "/api"}]
            messages = [{"role": "user", "content": "hi"}]
            ids = api.post(f"{s.url}/tokenize", json={"messages": messages}).json()["tokens"]
            text = api.post(f"{s.url}/detokenize", json={"tokens": ids}).json()["prompt"]
            assert text == "[user] hi\nANSWER:"
            marked = api.post(f"{s.url}/tokenize", json={"prompt": "<|mark|>", "add_special_tokens": False})
            assert len(marked.json()["tokens"]) == 1, marked.text
            body = {"messages": messages, "max_tokens": 2, "temperature": 0}
            r = api.post(f"{s.url}/api/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(ids)
    finally:
        s.stop()
    said = log.read_text()
    assert "trust-remote-code: accepted, and changes nothing" in said
    assert '"POST /api/v1/chat/completions HTTP/1.1" 200' in said  # uvicorn's access log, at info
    assert "kvserve.server.requests" not in said and "POST /v1/chat/completions 200" not in said


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-model-len", "512"], "max-model-len: not used by --engine naive"),
        (["--kv-cache-memory", "64MiB"], "kv-cache-memory: not used by --engine naive"),
        (["--max-logprobs", "50"], "max-logprobs: not used by --engine naive"),
        (["--request-timeout", "5"], "request-timeout: not used by --engine naive"),
        (["-dp", "1"], "data-parallel-size: not used by --engine naive"),
        (
            ["--served-model-name", "a", "b"],
            "served-model-name: --engine naive serves the model under one name",
        ),
    ],
)
def test_the_naive_baseline_refuses_flags_it_would_drop(flags, message, tmp_path, capsys):
    """--engine naive served with every engine and server flag silently dropped (the model's own
    context, no timeout, the first name only): now each is refused before the model loads."""
    assert main(["serve", str(tmp_path / "model"), "--engine", "naive", *flags]) == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")


def test_the_naive_baseline_takes_the_flags_it_honours():
    """--chat-template and --uvicorn-log-level reach serve_naive; vLLM's no-op flags pass."""
    from kvserve.entrypoints.cli import _naive_options

    args = _serve_args("m", "--engine", "naive", "--chat-template", TEMPLATE, "--uvicorn-log-level",
                       "info", "--served-model-name", "x", "--swap-space", "16",
                       "--disable-log-requests")  # fmt: skip
    assert _naive_options(args) is None
