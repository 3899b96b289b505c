"""trajproxy inside the trainers people use: verl, SkyRL, slime and TRL take rollouts of unmodified agents in
sandboxes through the adapters here, each answering the agents' calls with the trainer's own generate call
(`integrations.rollouts`), and `trajproxy train` trains a model on one machine with TRL (`integrations.train`).

This package sits above `proxy` and `sandbox` and uses both; neither imports it. Each framework's module imports its
framework, installed by the extra of its name (`pip install 'trajproxy[verl]'`), only when it is used."""
