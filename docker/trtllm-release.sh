# shellcheck shell=bash
# The TensorRT-LLM release rule of the trtllm profile, as a bash library: an
# engine loads only in the TensorRT-LLM release that built it, and a post-release
# or local build of that release (0.17.0.post1, 0.17.0+local) counts as the same
# release; other releases and pre-releases do not.
#
# Sourced, never run, by docker/build_engines.sh (the installed tensorrt_llm
# against TRTLLM_VERSION), docker/trtllm-entrypoint.sh (the image's tensorrt_llm
# against the engines' build-info.json) and the image build in
# docker/Dockerfile.trtllm (the base image's tensorrt_llm against TRTLLM_VERSION).
# The image keeps it next to them, in /opt/specdec/docker/. It defines functions
# only and leaves the shell's options alone.

# Usage: trtllm_release <version>
# Prints the release of a PEP 440 version with trailing zeros dropped: 0.17.0,
# 0.17, 0.17.0.post1 and 0.17.0+local all print 0.17. Fails (status 1, prints
# nothing) for pre-releases, dev releases and anything unparsable, which never
# count as a pinned release.
trtllm_release() {
    local version="${1,,}" release="" part
    local pattern='^v?([0-9]+(\.[0-9]+)*)([._-]?post[._-]?[0-9]*|-[0-9]+)?(\+[a-z0-9]+([._-][a-z0-9]+)*)?$'
    local -a parts
    [[ "${version}" =~ ${pattern} ]] || return 1
    IFS=. read -ra parts <<<"${BASH_REMATCH[1]}"
    for part in "${parts[@]}"; do
        release+="${release:+.}$((10#${part}))"
    done
    while [[ "${release}" == *.0 ]]; do
        release="${release%.0}"
    done
    printf '%s\n' "${release}"
}
