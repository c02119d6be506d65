"""What gathers pick mode's state in the background: endpoints, scrapes, KV-event sockets, the in-flight
channel, tokenizer checks."""
