"""Cache views: what each replica holds for a request (learned from picks, or exact from KV events), one interface."""
