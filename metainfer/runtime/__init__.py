"""What runs when an optimized model is called: the input guard, the serving engine's hook-up
(transformers' continuous batching running metainfer's graphs), speculative decoding and the
policy that decides when a serving step is compiled."""
