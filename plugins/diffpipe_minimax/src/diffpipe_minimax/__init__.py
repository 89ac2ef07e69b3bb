"""diffpipe model plugin: MiniMax H3 (joint video and audio generation) on diffusers' MiniMaxH3Transformer3DModel."""
