"""The choice: a frozen snapshot of the replicas, their load, and the pure cost that picks one."""
