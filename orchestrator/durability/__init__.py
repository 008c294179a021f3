"""Durability: the state that outlives any one process, and the rules that keep it consistent when
processes die or services go away. It owns the workspace and its run directories, the local source
of truth for every run (`workspace.py`); leases, which say who holds a run directory or a study and
whether that holder is alive (`lease.py`); run storage, where run directories live durably across
nodes (`storage.py`), and an attempt's pull, checkpoint uploads and final push to it
(`storage_sync.py`); waiting out an outage of a service (`outage.py`); the ledger of every comparison
tried in the workspace (`ledger.py`); and the reaper that ends the processes a command started when it
dies (`reaper.py`). Durability may import only `tasks` (besides
`common`), never `attempt`, `driving`, `dispatch`, `tracking` or `cli`: it is the floor that the
driver, the attempt, the backends and tracking all stand on, so they import it and it imports none
of them.
"""
