# Sourced by the device scripts: finds NVRTC on the device machine and puts it on LD_LIBRARY_PATH
# under a name cudarc opens (libnvrtc.so or libnvrtc.so.<major>).
echo "== nvrtc"
NVRTC=$( (ls /usr/local/cuda/lib64/libnvrtc.so* 2>/dev/null; find / -xdev -name 'libnvrtc.so*' 2>/dev/null) | grep -v builtins | head -1)
echo "found: ${NVRTC:-none}"
if [ -n "$NVRTC" ]; then
  export LD_LIBRARY_PATH="$(dirname "$NVRTC")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [ -e "$(dirname "$NVRTC")/libnvrtc.so" ] || { mkdir -p /tmp/nvrtc && ln -sf "$NVRTC" /tmp/nvrtc/libnvrtc.so && export LD_LIBRARY_PATH="/tmp/nvrtc:$LD_LIBRARY_PATH"; }
fi
