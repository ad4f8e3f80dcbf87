"""Moving tensors between instances: EC connectors (encoder → LM) and, later, KV connectors."""
