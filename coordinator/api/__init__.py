"""The researcher and admin API (``tuneplane.v1.Api``): RPC handlers that check, call the
store and answer. No SQL here; the store holds it.
"""
