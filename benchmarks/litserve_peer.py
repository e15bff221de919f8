"""LitServe serving a torchcls artifact: the peer that benchmarks/serve_load.py --peers litserve measures.

    python benchmarks/litserve_peer.py ARTIFACT --port P --max-batch B --max-wait-ms W --threads T

The model is loaded with torchcls' own load_artifact, so LitServe runs the identical model in the identical
precision as `torchcls serve` and the raw baseline; only the serving stack differs. It answers the same OIP
infer request (POST /v2/models/<name>/infer, one FP32 image of the model's input shape) with the logits,
and reports the batch it ran in the X-Batch-Size header, as `torchcls serve` does. LitServe's public API
only: one inference worker process, its dynamic batching (max_batch_size, batch_timeout), /health.
Needs the `bench` extra (litserve).
"""

import argparse
import math

import litserve as ls
import numpy as np
import orjson
import torch
from fastapi import HTTPException, Response


class ArtifactAPI(ls.LitAPI):
    """A torchcls artifact behind LitServe. Constructed in the server process and pickled to the inference
    worker, so it holds only the path until setup() loads the model there."""

    def __init__(self, path: str, name: str, shape: list[int], threads: int, **kwargs):
        super().__init__(**kwargs)
        self.path, self.name, self.shape, self.threads = path, name, shape, threads

    def setup(self, device) -> None:  # in the inference worker; LitServe's device is "cpu"
        from torchcls.artifacts.artifact import load_artifact

        if self.threads:
            torch.set_num_threads(self.threads)
        self.artifact = load_artifact(self.path)  # the same defaults (device, precision) as torchcls serve

    def decode_request(self, request) -> torch.Tensor:
        """One OIP input tensor, exactly the model's [1, C, H, W] (LitServe batches requests, not the
        client), parsed into float32. Anything else is a 400 naming what was expected."""
        try:
            (tensor,) = request["inputs"]
            shape, data = [int(d) for d in tensor["shape"]], tensor["data"]
            ok = tensor["datatype"] == "FP32" and shape == self.shape and len(data) == math.prod(shape)
            array = np.asarray(data, dtype=np.float32) if ok else None
        except (KeyError, TypeError, ValueError) as e:
            raise HTTPException(400, f"bad OIP infer request: {type(e).__name__}: {e}") from None
        if array is None or array.shape != (math.prod(shape),):
            raise HTTPException(400, f"expected one FP32 input of shape {self.shape} with flat data")
        return torch.from_numpy(array.reshape(shape))

    def batch(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(inputs)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.artifact(x)

    def unbatch(self, output: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        return [(row, len(output)) for row in output]

    def encode_response(self, output: tuple[torch.Tensor, int]) -> Response:
        logits, batch = output
        body = {"model_name": self.name, "outputs": [
            {"name": "logits", "datatype": "FP32", "shape": [1, len(logits)], "data": logits.tolist()}]}
        return Response(orjson.dumps(body), media_type="application/json", headers={"X-Batch-Size": str(batch)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads in the inference worker (0 = default)")
    args = p.parse_args()

    from torchcls.artifacts.artifact import load_artifact

    info = load_artifact(args.artifact).info  # the name and input shape; the worker loads its own copy
    pre = info.preprocess
    api = ArtifactAPI(args.artifact, info.name, [1, pre.channels, pre.img_size, pre.img_size], args.threads,
                      max_batch_size=args.max_batch, batch_timeout=args.max_wait_ms / 1e3,
                      api_path=f"/v2/models/{info.name}/infer")
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1)
    server.run(host="127.0.0.1", port=args.port, log_level="warning", generate_client_file=False)


if __name__ == "__main__":
    main()
