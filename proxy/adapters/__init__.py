"""The core's ports implemented with outside libraries: tiktoken's token counter, litellm's upstream, a served
policy's upstream, Prometheus metrics."""
