// How a new stream connection proves that both ends belong to the same process group, without
// the group's secret ever crossing the wire.
//
// The dialer sends its Hello (with a fresh random nonce); the acceptor answers with its own
// Hello (its own nonce) and a proof; the dialer checks it and sends its proof; only then does
// the acceptor admit the connection. A proof is HMAC-SHA256 under the group's key of a role
// label and both Hellos, compared in constant time. Each side's proof covers the other side's
// fresh nonce, so a recorded proof is useless on a later connection (no replay), and it covers
// every field of both Hellos (rank, lane, pid), so none can be altered on the way.
//
// What the key protects: a connection to a listener from someone who cannot read the group's
// store. The c10d store itself has no authentication (the trust model of gloo and NCCL): anyone
// who can reach the store can read the key. Traffic after the handshake is not encrypted.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dicomm {

// First bytes on every new connection, in both directions.
struct Hello {
  uint64_t magic = 0;
  int32_t rank = -1;
  int32_t pid = 0;
  uint64_t probe = 0;       // address of a known word in the sender (cross-memory attach probe)
  uint8_t nonce[32] = {0};  // fresh per connection
  int32_t lane = 0;         // which connection of the pair this is (0: the main one)
  int32_t lanes = 1;        // how many connections the dialer opens to this peer
};
static_assert(sizeof(Hello) == 64, "Hello is a wire format");
constexpr uint64_t kHelloMagic = 0x336d6d6f4369446cULL;  // "lDiComm3"

using Proof = std::array<uint8_t, 32>;

enum class HandshakeRole : uint8_t { kAcceptor, kDialer };

// Fills `nonce` from the kernel's random source; throws if it cannot.
void freshNonce(uint8_t (&nonce)[32]);

// The proof `role` sends on the connection whose Hellos are `dialer` and `acceptor`.
Proof handshakeProof(const std::vector<uint8_t>& key, HandshakeRole role, const Hello& dialer,
                     const Hello& acceptor);

// Constant-time comparison of a received proof with the expected one.
bool proofMatches(const Proof& expected, const uint8_t* received);

}  // namespace dicomm
