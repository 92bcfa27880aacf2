"""Python client for the Lockstep elastic training service.

    import lockstep
    client = lockstep.Client("127.0.0.1:7070", token="...")
    job = client.submit({"model": {"mlp": {"hiddenWidths": [64]}}, ...})
    for event in client.watch(job.job_id):
        print(event.message)

Jobs, workers and events are the service's protobuf messages (lockstep.v1); lockstep.to_dict
turns one into the JSON mapping `lockstepctl --output=json` prints. Every failure is a
LockstepError carrying the gRPC status code and the coordinator's message. A token sent in
plaintext beyond loopback draws an InsecureTokenWarning.
"""
from lockstep.client import Client, InsecureTokenWarning, LockstepError, to_dict

__all__ = ["Client", "InsecureTokenWarning", "LockstepError", "to_dict"]
