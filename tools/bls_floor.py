"""``python -m tools.bls_floor``: the floor of one BLS engine call on this host,
what Triton's Python backend costs a decoupled engine call before any
coordinator or engine work is done.

It starts a tritonserver with two throwaway Python models. ``echo`` is
decoupled like the engines: its ``execute`` reads the inputs of a greedy
engine call in the tensorrtllm contract (and how long to sleep) and queues the
call for an engine thread, which sleeps that long and answers with
``output_ids`` and ``sequence_length``, as the sim engine does. ``caller``
calls it back to back from its ``execute`` (``exec(decoupled=True)``, every
response read; no asyncio, no thread hop) and times each call less the sleep:
the least any coordinator running as a Python BLS model pays per engine call
here. A speculative round makes two such calls (draft, then verify), so twice
the floor is the least a round costs beyond its forwards; the sim profile's
speed-ups (tools/sim_bench.py) are bounded by it. An engine that sleeps shows
what waking the idle processes of each hop costs on the host. On a GPU host the
engines are TensorRT-LLM's C++ backend, so the engine side of the hop is
in-process there, cheaper than the Python ``echo`` here: the floor printed is
an upper bound of that part.
"""

from __future__ import annotations

import argparse
import json
import os
import site
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from selfheal import readiness
from tools.bench import parse_windows
from tools.sim_bench import cpu_seconds, free_port, machine, stubs_by_model_path

# The scalar inputs of a greedy engine call in the tensorrtllm contract
# (coordinator/engines/tensors.py), each [1, 1], beside input_ids [1, n].
SCALARS = (("input_lengths", "TYPE_INT32"), ("request_output_len", "TYPE_INT32"), ("end_id", "TYPE_INT32"),
           ("pad_id", "TYPE_INT32"), ("beam_width", "TYPE_INT32"), ("temperature", "TYPE_FP32"),
           ("runtime_top_k", "TYPE_INT32"), ("runtime_top_p", "TYPE_FP32"), ("random_seed", "TYPE_UINT64"),
           ("streaming", "TYPE_BOOL"), ("engine_ms", "TYPE_FP32"))
ECHO_CONFIG = """name: "echo"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "input_ids" data_type: TYPE_INT32 dims: [ -1, -1 ] },
""" + ",\n".join(f'  {{ name: "{name}" data_type: {kind} dims: [ -1, -1 ] }}' for name, kind in SCALARS) + """ ]
output [ { name: "output_ids" data_type: TYPE_INT32 dims: [ -1, -1, -1 ] },
         { name: "sequence_length" data_type: TYPE_INT32 dims: [ -1, -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
CALLER_CONFIG = """name: "caller"
backend: "python"
max_batch_size: 0
input [ { name: "calls" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "context" data_type: TYPE_INT32 dims: [ 1 ] },
        { name: "engine_ms" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "seconds" data_type: TYPE_FP64 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
# The stub embeds Python in isolated mode: numpy comes from the paths passed here.
PRELUDE = """import os, sys
for _path in reversed(os.environ.get("BLS_FLOOR_PYTHONPATH", "").split(os.pathsep)):
    if _path and _path not in sys.path:
        sys.path.insert(0, _path)
import queue
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils
"""
# As the sim engine: execute reads every input and queues the call; an engine
# thread takes it, sleeps the forward's time and sends the answer.
ECHO_MODEL = PRELUDE + f"""
NAMES = ("input_ids",) + {tuple(name for name, _ in SCALARS)!r}
""" + '''
class TritonPythonModel:
    def initialize(self, args):
        self.calls = queue.Queue()
        threading.Thread(target=self._engine, daemon=True).start()

    def execute(self, requests):
        for request in requests:
            inputs = {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name in NAMES}
            self.calls.put((request.get_response_sender(), inputs))
        return None

    def _engine(self):
        while True:
            sender, inputs = self.calls.get()
            seconds = float(inputs["engine_ms"].reshape(-1)[0]) / 1000.0
            if seconds > 0:
                time.sleep(seconds)
            token = inputs["input_ids"][:, -1:].reshape(1, 1, 1).copy()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("output_ids", token),
                                                    pb_utils.Tensor("sequence_length", np.ones((1, 1), np.int32))]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''
CALLER_MODEL = PRELUDE + f"""
SCALARS = {tuple((name, {"TYPE_INT32": "int32", "TYPE_FP32": "float32", "TYPE_UINT64": "uint64", "TYPE_BOOL": "bool_"}[kind]) for name, kind in SCALARS)!r}
""" + '''
VALUES = {"request_output_len": 4, "end_id": 2, "pad_id": 2, "beam_width": 1, "temperature": 1.0,
          "runtime_top_k": 1, "runtime_top_p": 1.0, "random_seed": 7, "streaming": False}


class TritonPythonModel:
    def execute(self, requests):
        answers = []
        for request in requests:
            read = lambda name: pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0]
            calls, engine_ms = int(read("calls")), float(read("engine_ms"))
            ids = np.arange(int(read("context")), dtype=np.int32).reshape(1, -1)
            values = dict(VALUES, input_lengths=ids.shape[1], engine_ms=engine_ms)
            seconds, held = [], []
            for _ in range(calls):
                started = time.perf_counter()
                inputs = [pb_utils.Tensor("input_ids", ids)]
                inputs += [pb_utils.Tensor(name, np.full((1, 1), values[name], dtype=getattr(np, kind)))
                           for name, kind in SCALARS]
                call = pb_utils.InferenceRequest(model_name="echo", inputs=inputs,
                                                 requested_output_names=["output_ids", "sequence_length"])
                stream = call.exec(decoupled=True)
                responses = list(stream)
                pb_utils.get_output_tensor_by_name(responses[0], "output_ids").as_numpy()
                seconds.append(time.perf_counter() - started - engine_ms / 1000.0)
                held.append((stream, responses))  # let go after the loop, never while Triton may still hold them
            answers.append(pb_utils.InferenceResponse([pb_utils.Tensor("seconds", np.asarray(seconds))]))
        return answers
'''
WARM_UP_CALLS = 50  # not counted: the first calls allocate the shared-memory pools


def write_repository(root: Path) -> None:
    for name, config, code in (("echo", ECHO_CONFIG, ECHO_MODEL), ("caller", CALLER_CONFIG, CALLER_MODEL)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
        (root / name / "1" / "model.py").write_text(code)


def summary(seconds: list[float]) -> dict:
    ms = sorted(1000.0 * s for s in seconds)
    return {"calls": len(ms), "p10_ms": ms[len(ms) // 10], "p50_ms": statistics.median(ms),
            "p90_ms": ms[len(ms) * 9 // 10]}


def measure(calls: int, contexts: list[int], engine_ms: list[float], progress=print) -> dict:
    """Per context length and engine time: a call's time beyond the engine's sleep, and the
    CPU the caller's stub, the echo's stub and tritonserver spent per call."""
    from launcher.assets import default_cache_dir
    from launcher.tritonserver import locate

    install = locate(default_cache_dir())
    http = free_port()
    paths = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    with tempfile.TemporaryDirectory(prefix="bls-floor-") as workdir:
        repository, log = Path(workdir) / "models", Path(workdir) / "tritonserver.log"
        write_repository(repository)
        env = dict(os.environ, LD_LIBRARY_PATH=str(install.library_dir),
                   BLS_FLOOR_PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)))
        with log.open("wb") as output:
            server = subprocess.Popen(
                [str(install.binary), f"--model-repository={repository}", f"--backend-directory={install.backend_dir}",
                 "--http-address=127.0.0.1", f"--http-port={http}", "--allow-grpc=false", "--allow-metrics=false",
                 f"--backend-config=python,shm-region-prefix-name=bls_floor_{os.getpid()}_"],
                env=env, stdout=output, stderr=subprocess.STDOUT)
        try:
            try:
                readiness.wait_for(server, f"http://127.0.0.1:{http}/v2/health/ready", "tritonserver", 120.0)
            except (RuntimeError, TimeoutError) as error:
                raise SystemExit(f"bls_floor: {error}:\n{log.read_text(errors='replace')[-2000:]}") from None
            client = httpclient.InferenceServerClient(f"127.0.0.1:{http}", network_timeout=600)
            pids = stubs_by_model_path(server.pid, {"caller": b"/caller/", "echo": b"/echo/"})
            pids["tritonserver"] = server.pid
            results = []
            for context in contexts:
                for sleep in engine_ms:
                    _call(client, WARM_UP_CALLS, context, sleep)
                    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
                    seconds = _call(client, calls, context, sleep)
                    cpu = {name: 1000.0 * (cpu_seconds(pid) - before[name]) / calls for name, pid in pids.items()}
                    row = {"context_tokens": context, "engine_ms": sleep, **summary(seconds), "cpu_ms_per_call": cpu}
                    results.append(row)
                    progress(f"context {context}, engine {sleep:g} ms: a BLS call beyond the engine's time p50 "
                             f"{row['p50_ms']:.3f} ms (p10 {row['p10_ms']:.3f}, p90 {row['p90_ms']:.3f}) over "
                             f"{calls} calls; CPU ms a call: " + ", ".join(f"{name} {value:.3f}"
                                                                         for name, value in cpu.items()))
            return {"machine": machine(), "calls": calls, "results": results}
        finally:
            server.kill()
            server.wait(30)


def _call(client, calls: int, context: int, engine_ms: float) -> list[float]:
    inputs = [httpclient.InferInput("calls", [1], "INT32"), httpclient.InferInput("context", [1], "INT32"),
              httpclient.InferInput("engine_ms", [1], "FP32")]
    inputs[0].set_data_from_numpy(np.array([calls], dtype=np.int32))
    inputs[1].set_data_from_numpy(np.array([context], dtype=np.int32))
    inputs[2].set_data_from_numpy(np.array([engine_ms], dtype=np.float32))
    return [float(s) for s in client.infer("caller", inputs).as_numpy("seconds")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bls_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500, help="timed calls per setting (default 500)")
    parser.add_argument("--contexts", type=parse_windows, default=[200, 2000], metavar="N,N,...",
                        help="context lengths in tokens (default 200,2000)")
    parser.add_argument("--engine-ms", default="0,1.5,7", metavar="MS,MS,...",
                        help="milliseconds the echo's engine thread sleeps before it answers "
                             "(default 0,1.5,7: at once, and the h100-8b-1b sim preset's draft and target steps)")
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    if not args.contexts or min(args.contexts) < 1:
        parser.error(f"--contexts must be token counts of at least 1, got {args.contexts}")
    try:
        engine_ms = [float(v) for v in args.engine_ms.split(",")]
    except ValueError as error:
        parser.error(f"--engine-ms: {error}")
    if not all(0 <= v <= 1000 for v in engine_ms):
        parser.error(f"--engine-ms: each value must be 0 to 1000 ms, got {args.engine_ms}")
    result = measure(args.calls, args.contexts, engine_ms, progress=lambda line: print(line, flush=True))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
