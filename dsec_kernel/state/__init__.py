"""Cluster state in JetStream KV, in parts: :mod:`.buckets` (the buckets, their layout, opening
them), :mod:`.mirror` (an in-memory copy of a bucket kept by a watch), :mod:`.jetstream`
(writes that ride out leader elections, stream replicas), :mod:`.tenants` (credential
records and NATS passwords) and :mod:`.facade` (:class:`~.facade.ClusterState`, the one
writer of KV). Import each name from the part that holds it.
"""
