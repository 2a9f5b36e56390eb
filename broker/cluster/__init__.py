"""Several brokers as one router, over a NATS backplane (BROKER-SPEC section 8)."""
