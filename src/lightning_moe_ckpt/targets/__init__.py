"""Training targets: the built-in engine, a Lightning Trainer module and a Fabric loop."""
