"""The apiserver: authenticates callers, places sandboxes and forwards work to edges.

It serves ``dsec.api.v1.*`` in the queue group ``apiserver``, so any number can run. It holds
no state of its own: nodes, sandboxes and tenants live in JetStream KV and are mirrored in
memory through watches. Every apiserver also watches for nodes whose heartbeats stop: the first
to mark one down (compare-and-set) reports that node's sandboxes lost.

:class:`~.server.ApiServer` composes parts, each given only what it uses, and declares their
endpoints (``bus.Endpoint``): the bus authenticates, parses the request and maps errors
for every one of them, so a handler is given the parsed request and the caller's tenant.

The parts:

* :mod:`.auth` — the tenant a credential belongs to, which the bus authenticates with;
* :mod:`.registry` — the sandbox records and their indexes (by node, tenant, request id,
  job, expiry), and looking a caller's sandbox up;
* :mod:`.nodes` — the node views, placements their heartbeats do not count yet, down events;
* :mod:`.liveness` — nodes whose heartbeats stop marked down, their sandboxes lost;
* :mod:`.edges` — calls to the nodes' edges;
* :mod:`.specs` — a spec's backend (the cluster's default), job and capabilities checked;
* :mod:`.admission` — quotas, queues and priorities;
* :mod:`.creating` — admission, placement, the edges' creates, the records, rollback;
* :mod:`.destroying` — edges' destroys, then the records;
* :mod:`.reaper` — sandboxes past their TTL destroyed;
* :mod:`.leases` — trainers' job leases; :mod:`.pools` — warm pools;
* :mod:`.routing` — requests the edges answer (commands, files, snapshots, pause...);
* :mod:`.queries` — requests answered here (list, status, nodes, history).
"""

from dsec_kernel.apiserver.server import ApiServer

__all__ = ["ApiServer"]
