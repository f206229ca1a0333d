"""A client of a Ray instance that has no token (run by tests/ray_helpers.call_without_token, in a
process whose environment and home hold none): gRPC calls (an empty request to each
`[address, "/package.Service/Method"]`), and a job submission to the node's agent; prints what
each answered, as JSON. An optional second argument is a token to send (the control)."""
from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

import grpc


def grpc_call(address: str, method: str, token: str | None) -> str:
    metadata = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            call(b"", timeout=30, metadata=metadata)  # b"": an empty message of any request type
            return "OK"
        except grpc.RpcError as e:
            return e.code().name


def submit_job(url: str) -> int:
    body = json.dumps({"entrypoint": "echo this should never run"}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def main(targets: dict, token: str | None) -> dict:
    out = {"grpc": [grpc_call(address, method, token) for address, method in targets["grpc"]]}
    if targets.get("jobs") and not token:  # (no control here: with the token, a job would run)
        out["jobs"] = submit_job(targets["jobs"])
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)))
