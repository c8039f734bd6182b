"""Workload source shared by the tests whose ranks meet at the rendezvous.

:data:`MEET_PY` defines ``meet(rank, world, addr)``; a test's payload script starts with it and
calls it. It is plain Python with no TunePlane import, so it runs on the host, in a runtime image
or on a Slurm node alike.
"""

from __future__ import annotations

# Rank 0 listens at ``addr`` (MASTER_ADDR:MASTER_PORT); every other rank connects, retrying until
# rank 0 is up (60 s), and says its rank; once all ``world`` ranks are in, rank 0 answers everyone
# with the sorted list of ranks, which every rank returns.
MEET_PY = r"""
def meet(rank, world, addr):
    import json, socket, time
    if rank == 0:
        server = socket.create_server(addr)
        server.settimeout(60)
        peers, seen = [], [0]
        while len(seen) < world:
            conn, _ = server.accept()
            seen.append(int(conn.makefile().readline()))
            peers.append(conn)
        answer = (json.dumps(sorted(seen)) + "\n").encode()
        for conn in peers:
            conn.sendall(answer)
            conn.close()
        server.close()
        return sorted(seen)
    deadline = time.monotonic() + 60
    while True:
        try:
            conn = socket.create_connection(addr, timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    conn.sendall(f"{rank}\n".encode())
    met = json.loads(conn.makefile().readline())
    conn.close()
    return met
"""
