"""xmcserve training: UniDEC / RAE-XMC training of the encoder and its heads, with the exact-search
dev check of each epoch. The data readers, metrics and evaluation it uses live in :mod:`xmc`."""
