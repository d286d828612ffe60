"""xmcserve training: XMC data readers, metrics, evaluation, UniDEC / RAE-XMC training."""
