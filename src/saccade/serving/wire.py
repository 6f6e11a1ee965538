"""What a `saccade serve` server and its client (`saccade.inference.vllm`) both spell.

Routes, the response header that carries the policy version, the name the trainer's adapter is
served under, the images one request may carry. No imports: the client reads these without
loading the server's module (which needs vLLM).
"""

# saccade's own routes (serving/server.py)
ENCODE_IMAGES = "/encode_images"
ENCODE_VIDEOS = "/encode_videos"  # clips' features, as /encode_images images' (serving/server.py)
UPDATE_WEIGHTS = "/update_weights"
INFO = "/saccade/info"
# The weight-transfer phases, under vLLM's own names (vllm/entrypoints/rl/online/api_router.py,
# which `saccade serve` does not mount): /update_weights with {"update_info": ...} is a chunk of
# a collective update, with {"path": ...} a folder (serving/server.py).
INIT_TRANSFER = "/init_weight_transfer_engine"
START_UPDATE = "/start_weight_update"
FINISH_UPDATE = "/finish_weight_update"
SHUTDOWN_TRANSFER = "/shutdown_weight_transfer_engine"
SACCADE_ROUTES = (ENCODE_IMAGES, ENCODE_VIDEOS, UPDATE_WEIGHTS, INIT_TRANSFER, START_UPDATE, FINISH_UPDATE, SHUTDOWN_TRANSFER,
                  "/saccade/")  # errors as {"error": reason}
# The weight-transfer engine `saccade serve` registers with vLLM's factory (serving/transfer.py),
# and the prefix its process group's keys take in the trainer's TCPStore.
GLOO_BACKEND = "saccade_gloo"
TRANSFER_STORE_PREFIX = "saccade-weights"

# vLLM's routes the client samples through
CHAT_COMPLETIONS = "/v1/chat/completions"
GENERATE_TOKENS = "/inference/v1/generate"  # token prompts in, as `saccade serve` enables it

# The policy version a server held when a request arrived, on every response.
VERSION_HEADER = "x-saccade-policy-version"
# The name the trainer's LoRA adapter is loaded under; requests name it as their model.
LORA_NAME = "saccade-policy"
# The most images one /encode_images request may carry (the client chunks its batches to it).
MAX_IMAGES_PER_REQUEST = 256
# ... and at most this many pixels, decoded, all its images together (2**28: 768 MiB in RGB, four
# images of the 8192^2 pixels a trainer's images.max_source_pixels allows by default). The client
# chunks its batches to it too.
MAX_PIXELS_PER_REQUEST = 2**28
# The most frames one request may carry, all its clips together (/encode_videos, or a chat request's
# frame-sequence URLs): Qwen3-VL's processor samples at most 768 a clip. The client sends a clip's
# frames in one request, so a clip of more is refused before it is sent.
MAX_FRAMES_PER_REQUEST = 1024
# vLLM's media type for a clip sent as frames (multimodal/media/video.py, `VideoMediaIO.load_base64`):
# the payload is the frames' base64, comma-separated, each read as an image whatever its format.
# saccade's client sends a clip's sampled frames so, PNG (lossless), to the chat route and /encode_videos.
FRAMES_URL_PREFIX = "data:video/jpeg;base64,"
# The one route answered without the API key: the health probe (the launcher's, a load balancer's).
HEALTH = "/health"
