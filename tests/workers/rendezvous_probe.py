"""A process that is not in the job tries the job's Gloo rendezvous (issue 38).

    python rendezvous_probe.py ADDRESS PORT LAUNCHER_PID UNPICKLED [TOKEN]

Until the job's launcher (horovodrun, LAUNCHER_PID) has ended or 300 s have passed, it reads
a rank's entry, overwrites the ranks' entries with garbage, deletes one, and reads a key it wrote;
each request with TOKEN as the token header when one is given. It also asks for an elastic
worker's address and HMAC key, and puts a worker address whose value, once unpickled (as
Horovod's elastic rendezvous unpickles what it is sent), creates the file UNPICKLED. It
prints one JSON line: the count of each answer ("403", "200", ..., "refused" for a
connection refused).
"""

import base64
import collections
import http.client
import json
import os
import pickle
import sys
import time

TOKEN_HEADER = "X-Horovod-Rendezvous-Token"


class Unpickled:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


REQUESTS = [
    ("GET", "/worker_addresses/localhost:0", None),
    ("GET", "/global/0", None),
    ("PUT", "/global/0", b"garbage"),
    ("PUT", "/global/1", b"garbage"),
    ("PUT", "/probe_scope/x", b"probe"),
    ("GET", "/probe_scope/x", None),
    ("DELETE", "/global/1", None),
]


def ask(address, port, method, path, body, token):
    conn = http.client.HTTPConnection(address, port, timeout=5)
    try:
        conn.request(method, path, body=body, headers={TOKEN_HEADER: token} if token else {})
        return str(conn.getresponse().status)
    except ConnectionRefusedError:
        return "refused"
    except OSError as e:  # reset or closed by a server that refused the request
        return type(e).__name__
    finally:
        conn.close()


def main():
    address, port, launcher = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    token = sys.argv[5] if len(sys.argv) > 5 else None
    value = base64.b64encode(pickle.dumps(Unpickled(sys.argv[4])))
    requests = [*REQUESTS, ("PUT", "/worker_addresses/localhost:9", value)]
    answers = collections.Counter()
    deadline = time.monotonic() + 300
    while os.path.exists(f"/proc/{launcher}") and time.monotonic() < deadline:
        answers.update(ask(address, port, m, p, b, token) for m, p, b in requests)
        time.sleep(0.01)  # pace: about 100 rounds a second, not a whole core of the job's
    print(json.dumps({"answers": dict(answers)}), flush=True)


if __name__ == "__main__":
    main()
