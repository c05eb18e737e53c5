"""`nandoctor bisect`: the pure delta-debugging engine (engine.py), the factors of a search
(factors.py), and the oracle that runs real probes for it (oracle.py)."""
