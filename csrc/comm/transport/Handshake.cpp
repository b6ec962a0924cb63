#include "comm/transport/Handshake.h"

#include <errno.h>
#include <sys/random.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cstring>
#include <stdexcept>
#include <string>

namespace dicomm {

void freshNonce(uint8_t (&nonce)[32]) {
  size_t got = 0;
  while (got < sizeof(nonce)) {
    const ssize_t k = ::getrandom(nonce + got, sizeof(nonce) - got, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) throw std::runtime_error("dicomm: getrandom() failed: " + std::to_string(errno));
    got += static_cast<size_t>(k);
  }
}

Proof handshakeProof(const std::vector<uint8_t>& key, HandshakeRole role, const Hello& dialer,
                     const Hello& acceptor) {
  // Labelled by role, so the acceptor's proof can never be sent back as the dialer's.
  static constexpr char kLabel[2][16] = {"dicomm-accept-1", "dicomm-dial-1"};
  uint8_t message[sizeof(kLabel[0]) + 2 * sizeof(Hello)];
  std::memcpy(message, kLabel[static_cast<int>(role)], sizeof(kLabel[0]));
  std::memcpy(message + sizeof(kLabel[0]), &dialer, sizeof(Hello));
  std::memcpy(message + sizeof(kLabel[0]) + sizeof(Hello), &acceptor, sizeof(Hello));
  Proof proof{};
  unsigned int length = 0;
  if (!HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), message, sizeof(message),
            proof.data(), &length) ||
      length != proof.size()) {
    throw std::runtime_error("dicomm: HMAC-SHA256 of the handshake failed (OpenSSL)");
  }
  return proof;
}

bool proofMatches(const Proof& expected, const uint8_t* received) {
  return CRYPTO_memcmp(expected.data(), received, expected.size()) == 0;
}

}  // namespace dicomm
