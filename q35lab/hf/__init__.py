"""How transformers and PEFT build Qwen3.5, as q35lab sees it: class names and predicates (``modules``), the
instance-level forward every patch installs (``forwards``), the GatedDeltaNet's conv and delta-rule switches
(``gated_delta_net``), and the releases q35lab supports with what differs between them (``versions``)."""
