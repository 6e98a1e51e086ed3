"""Scheduling: requests' scheduling state, the continuous-batching scheduler and the paged KV blocks."""
