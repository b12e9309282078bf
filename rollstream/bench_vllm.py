"""`rollstream bench vllm`: a real vLLM server (consumers.vllm_server) behind the recording
gateway: weight-push seconds, generation tokens per second, and the training-inference
mismatch of what it serves.

    rollstream bench vllm                          # a tiny Qwen2 built here, float32
    rollstream bench vllm --dtype bfloat16 --json
    rollstream bench vllm --model /models/my-hf-dir --concurrency 64 --tokens 256

What it measures, in one server started for the run:

- `start_s`: seconds until the server answers `GET /health`.
- `push_s`: `VLLMPublisher.load` of `--pushes` new versions (each the model with noise
  added): the whole push (writing the checkpoint directory, then pause, reload, cache reset,
  version, resume, the gateway told) and the engine's part alone (`engine_s`).
- `push_in_flight_s`: one push while `--concurrency` streamed calls of `--tokens` tokens run
  (pause waits for them: this is a push's worst case, about one generation).
- `tokens_per_s`: `--concurrency` concurrent completions of `--tokens` tokens each
  (`ignore_eos`), straight to vLLM and through the gateway (`rollstream gateway`, its own
  process): the median of `--rounds` interleaved rounds after a warm-up round.
- `mismatch`: the gateway's recorded behaviour log-probs of those completions against the
  model's own, computed here in float32 at the same temperature: mean and max |difference|
  and the share beyond 0.1 nats (`trainer.objective.MISMATCH_THRESHOLD`). In float32 this is
  the numerical floor; in bfloat16 it is the engine's dtype drift.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pipeline.errors import CommandError

NAME = "bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a Hugging Face model directory (default: a tiny Qwen2 built here)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per completion")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds (after a warm-up), the median counts")
    parser.add_argument("--json", action="store_true")


def _perturbed(model: Any, seed: int) -> Any:
    import torch

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return other


def _concurrent(n: int, call: Any) -> float:
    """Seconds for `n` threads each running `call(i)` once, together."""
    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - start


def _generate(http: Any, base: str, prompts: list[list[int]], tokens: int, temperature: float) -> tuple[float, int]:
    """(seconds, completion tokens) of one completion per prompt, all at once, at `base`."""
    done: list[int] = []

    def call(i: int) -> None:
        answer = http.post(f"{base}/completions", json={
            "model": NAME, "prompt": prompts[i], "max_tokens": tokens, "ignore_eos": True,
            "temperature": temperature, "logprobs": 0, "return_token_ids": True})
        answer.raise_for_status()
        done.append(len(answer.json()["choices"][0]["token_ids"]))

    seconds = _concurrent(len(prompts), call)
    return seconds, sum(done)


def _mismatch(model: Any, calls: list[dict[str, Any]], temperature: float) -> dict[str, float]:
    import torch

    from trainer.objective import MISMATCH_THRESHOLD

    gaps = []
    for c in calls:
        ids = torch.tensor([c["prompt_ids"] + c["completion_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
        n = len(c["prompt_ids"])
        mine = logp[n - 1:-1].gather(-1, torch.tensor(c["completion_ids"])[:, None])[:, 0]
        gaps.append((torch.tensor(c["logprobs"]) - mine).abs())
    d = torch.cat(gaps)
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max()),
            "share_over_threshold": float((d > MISMATCH_THRESHOLD).float().mean()), "tokens": int(d.numel())}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    from consumers.vllm_server import VLLMServer, missing
    from pipeline.processes import free_port
    from producers.engine_publishers import VLLMPublisher
    from trainer.hf_dir import write_model_dir

    why = missing()
    if why is not None:
        raise CommandError(f"vllm: {why}")
    out: dict[str, Any] = {"dtype": args.dtype, "concurrency": args.concurrency, "tokens": args.tokens,
                           "temperature": args.temperature, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-vllm-") as tmp:
        model_dir = Path(args.model) if args.model else write_model_dir(Path(tmp) / "model")
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
        out["model"] = str(args.model or "tiny qwen2 (trainer.hf_dir)")
        out["parameters"] = sum(p.numel() for p in model.parameters())
        server = VLLMServer(model_dir, port=free_port(), log=Path(tmp) / "vllm.log",
                            options={"name": NAME, "dtype": args.dtype})
        gateway = None
        try:
            gateway, gw_url = _gateway(server.url, Path(tmp) / "gateway.log")
            with httpx.Client(timeout=600) as http:
                out["start_s"] = round(server.started_s, 1)
                publisher = VLLMPublisher([server.url], Path(tmp) / "weights", gateways=[gw_url], timeout_s=600)
                publisher.preflight()
                totals = []
                for version in range(1, args.pushes + 1):
                    pushed = _perturbed(model, version)
                    start = time.monotonic()
                    publisher.load(pushed, version)
                    totals.append(time.monotonic() - start)
                out["push_s"] = {"median": statistics.median(totals), "max": max(totals),
                                 "engine_median": statistics.median(publisher.seconds)}
                served = _perturbed(model, args.pushes)  # what vLLM serves now

                g = torch.Generator().manual_seed(0)
                vocab = model.config.vocab_size
                prompts = [torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(args.concurrency)]
                _generate(http, f"{server.url}/v1", prompts, args.tokens, args.temperature)  # warm-up
                rates: dict[str, list[float]] = {"vllm": [], "through_gateway": []}
                for r in range(args.rounds):  # interleaved, so both see the same machine load
                    for kind, base in (("vllm", f"{server.url}/v1"), ("through_gateway", f"{gw_url}/sessions/b{r}/v1")):
                        seconds, tokens = _generate(http, base, prompts, args.tokens, args.temperature)
                        rates[kind].append(tokens / seconds)
                out["tokens_per_s"] = {kind: round(statistics.median(v)) for kind, v in rates.items()}
                calls = [c for r in range(args.rounds) for c in http.get(f"{gw_url}/sessions/b{r}").json()["calls"]]
                out["mismatch"] = _mismatch(served, calls, args.temperature)

                # one push with a full load of streamed calls in flight
                started = threading.Barrier(args.concurrency + 1)

                def streamed(i: int) -> None:
                    with http.stream("POST", f"{gw_url}/sessions/s{i}/v1/completions", json={
                            "model": NAME, "prompt": prompts[i], "max_tokens": args.tokens, "ignore_eos": True,
                            "stream": True}) as r:
                        lines = r.iter_lines()
                        next(line for line in lines if line.startswith("data:"))
                        started.wait(600)
                        for _ in lines:
                            pass

                threads = [threading.Thread(target=streamed, args=(i,)) for i in range(args.concurrency)]
                for t in threads:
                    t.start()
                started.wait(600)
                start = time.monotonic()
                publisher.load(served, args.pushes + 1)
                out["push_in_flight_s"] = time.monotonic() - start
                for t in threads:
                    t.join()
                publisher.close()
        finally:
            if gateway is not None:
                gateway.stop()
            server.stop()
    return out


def _gateway(engine: str, log: Path) -> tuple[Any, str]:
    """`rollstream gateway` in front of `engine`, as its own process (as deployed); its URL
    once it answers."""
    import httpx

    from pipeline.processes import Process, free_port

    port = free_port()
    process = Process("gateway", [sys.executable, "-m", "rollstream.cli", "gateway", "--engine", engine,
                                  "--port", str(port)], log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass  # not listening yet
        if not process.alive or time.monotonic() > deadline:
            process.stop()
            raise CommandError(f"the gateway did not start: {process.output()[-2000:]}")
        time.sleep(0.1)


def run_from_args(args: argparse.Namespace) -> int:
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    push, tps, mm = result["push_s"], result["tokens_per_s"], result["mismatch"]
    lines = [
        f"model {result['model']} ({result['parameters']:,} parameters), dtype {result['dtype']}",
        f"server start            {result['start_s']:.1f} s",
        f"push (write + engine)   median {push['median']:.3f} s, max {push['max']:.3f} s "
        f"(engine alone {push['engine_median']:.3f} s)",
        f"push, calls in flight   {result['push_in_flight_s']:.2f} s ({result['concurrency']} calls of "
        f"{result['tokens']} tokens drained first)",
        f"tokens/s                {tps['vllm']} straight to vLLM, {tps['through_gateway']} through the gateway "
        f"({result['concurrency']} x {result['tokens']} tokens, median of {result['rounds']} rounds)",
        f"mismatch                mean |d| {mm['mean_abs']:.2e}, max {mm['max_abs']:.2e}, "
        f"share > 0.1: {mm['share_over_threshold']:.4f} ({mm['tokens']} tokens, T={result['temperature']})",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run_from_args(parser.parse_args()))
