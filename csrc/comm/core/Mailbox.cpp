#include "comm/core/Mailbox.h"

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>

#include "comm/core/Tags.h"
#include "comm/transport/Env.h"

namespace dicomm {

void Completion::complete(std::exception_ptr error, int source) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_.load(std::memory_order_relaxed)) return;
    error_ = std::move(error);
    source_ = source;
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
  if (callback_) {
    Callback cb = std::move(callback_);
    cb(*this);
  }
}

bool Completion::waitUntil(std::chrono::steady_clock::time_point until) {
  if (done()) return true;
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_until(lock, until, [&] { return done(); });
}

uint64_t maxMessageBytes() {
  static const uint64_t limit =
      static_cast<uint64_t>(envLong("DICOMM_MAX_MESSAGE_BYTES", 1L << 40, 1, 1L << 50));
  return limit;
}

void checkEnvelope(int peer, const Envelope& env) {
  const uint64_t kind = env.tag >> 60;
  const char* bad = nullptr;
  if (kind == 1 && (env.tag & 0x0fffffff00000000ULL)) {
    bad = "a point-to-point tag with bits set beyond its 32";
  } else if (kind == 3 && env.tag != abortNoticeTag()) {
    bad = "an unknown control tag";
  } else if (kind < 1 || kind > 3) {
    bad = "an unknown tag kind";
  } else if (env.dtype < -1 || env.dtype >= static_cast<int32_t>(c10::ScalarType::NumOptions)) {
    bad = "a dtype that is no c10::ScalarType";
  } else if (env.nbytes > maxMessageBytes()) {
    bad = "a size above DICOMM_MAX_MESSAGE_BYTES";
  }
  if (!bad) return;
  char tag[24];
  std::snprintf(tag, sizeof(tag), "0x%016llx", static_cast<unsigned long long>(env.tag));
  throw TransportError(peer, "dicomm: protocol error from rank " + std::to_string(peer) +
                                 ": a message with " + bad + " (tag " + tag + ", " +
                                 std::to_string(env.nbytes) + " bytes, dtype " +
                                 std::to_string(env.dtype) + ")");
}

static std::string dtypeName(int32_t dtype) {
  if (dtype < 0) return "untyped";
  return c10::toString(static_cast<c10::ScalarType>(dtype));
}

std::exception_ptr Mailbox::mismatch(const RecvRequest& r, int peer, const Envelope& env) const {
  const bool sizeBad = env.nbytes != r.nbytes;
  const bool typeBad = env.dtype >= 0 && r.dtype >= 0 && env.dtype != r.dtype;
  if (!sizeBad && !typeBad) return nullptr;
  return std::make_exception_ptr(TransportError(
      peer, std::string("dicomm: ") + (typeBad ? "dtype" : "size") + " mismatch on " +
                describeTag(env.tag) + ": rank " + std::to_string(peer) + " sent " +
                std::to_string(env.nbytes) + " bytes of " + dtypeName(env.dtype) + ", rank " +
                std::to_string(rank_) + " expects " + std::to_string(r.nbytes) + " bytes of " +
                dtypeName(r.dtype) + " (message dropped)"));
}

void Mailbox::deliver(Unexpected& m, RecvRequest& r) {
  if (m.error) {
    r.completion->complete(m.error, m.peer);
    return;
  }
  if (m.envelope.nbytes) std::memcpy(r.data, m.data.get(), m.envelope.nbytes);
  r.completion->complete(nullptr, m.peer);
}

void Mailbox::post(RecvRequest request) {
  auto r = std::make_shared<RecvRequest>(std::move(request));
  std::shared_ptr<Unexpected> found;
  std::exception_ptr bad;
  {
    std::lock_guard<std::mutex> lock(mu_);
    r->order = nextOrder_++;
    // Oldest unexpected message this receive can take.
    std::deque<std::shared_ptr<Unexpected>>* queue = nullptr;
    if (failed_) {
      bad = failed_;  // (queue stays null: the receive completes with the error below)
    } else if (r->peer >= 0) {
      auto it = unexpected_.find({r->peer, r->tag});
      if (it != unexpected_.end() && !it->second.empty()) queue = &it->second;
    } else {
      for (auto& kv : unexpected_) {
        if (kv.first.second != r->tag || kv.second.empty()) continue;
        if (!queue || kv.second.front()->order < queue->front()->order) queue = &kv.second;
      }
    }
    if (!queue) {
      auto closed = r->peer >= 0 ? closedPeers_.find(r->peer) : closedPeers_.end();
      if (!bad && closed != closedPeers_.end()) {
        // The peer shut down and nothing it sent matches: this receive can never complete.
        bad = std::make_exception_ptr(TransportError(r->peer, closed->second));
      } else if (!bad) {
        (r->peer >= 0 ? posted_[{r->peer, r->tag}] : postedAny_[r->tag]).push_back(r);
        return;
      }
    } else {
      found = queue->front();
      queue->pop_front();
      if (!found->deferred) {
        bad = mismatch(*r, found->peer, found->envelope);
        if (!bad && !found->complete) {
          found->claimedBy = r;  // its landing completes this receive
          return;
        }
      }
    }
  }
  if (!found) {
    r->completion->complete(bad, r->peer);
    return;
  }
  if (found->deferred) {
    auto ready = std::move(found->deferred);
    ready(landingFor(r, found->peer, found->envelope));
    return;
  }
  if (bad) {
    r->completion->complete(bad, found->peer);
  } else {
    deliver(*found, *r);
  }
}

std::shared_ptr<RecvRequest> Mailbox::takePosted(int peer, const Envelope& env) {
  auto p = posted_.find({peer, env.tag});
  auto a = postedAny_.find(env.tag);
  bool haveP = p != posted_.end() && !p->second.empty();
  bool haveA = a != postedAny_.end() && !a->second.empty();
  std::shared_ptr<RecvRequest> r;
  if (haveP && (!haveA || p->second.front()->order < a->second.front()->order)) {
    r = p->second.front();
    p->second.pop_front();
    if (p->second.empty()) posted_.erase(p);
  } else if (haveA) {
    r = a->second.front();
    a->second.pop_front();
    if (a->second.empty()) postedAny_.erase(a);
  }
  return r;
}

Landing Mailbox::landingFor(const std::shared_ptr<RecvRequest>& r, int peer, const Envelope& env) {
  Landing landing;
  if (auto bad = mismatch(*r, peer, env)) {
    r->completion->complete(bad, peer);
    landing.done = [](std::exception_ptr) {};
    return landing;  // data == nullptr: the transport drops the payload
  }
  landing.data = r->data;
  landing.capacity = r->nbytes;
  landing.done = [r, peer](std::exception_ptr error) { r->completion->complete(error, peer); };
  return landing;
}

Landing Mailbox::arrive(int peer, const Envelope& env) {
  checkEnvelope(peer, env);
  if (isControlTag(env.tag)) {
    // A peer aborted and says why: fail like a broken pair, with the peer's own cause.
    auto text = std::make_shared<std::string>(std::min<uint64_t>(env.nbytes, 1 << 16), '\0');
    Landing l;
    l.data = env.nbytes <= text->size() ? &(*text)[0] : nullptr;
    l.capacity = text->size();
    l.done = [this, peer, text](std::exception_ptr) {
      std::string cause = "rank " + std::to_string(peer) + " aborted its process group: " + *text;
      {
        std::lock_guard<std::mutex> lock(mu_);
        abortNotices_.emplace(peer, cause);
      }
      peerFailed(peer, cause);
    };
    return l;
  }
  std::shared_ptr<RecvRequest> r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    r = takePosted(peer, env);
    if (!r) {
      std::unique_ptr<char[]> data(new (std::nothrow) char[env.nbytes ? env.nbytes : 1]);
      if (!data) {
        throw TransportError(peer, "dicomm: cannot allocate " + std::to_string(env.nbytes) +
                                       " bytes for a message from rank " + std::to_string(peer) +
                                       " that no receive has claimed yet (" +
                                       describeTag(env.tag) + ")");
      }
      auto m = queueUnexpectedLocked(peer, env);
      m->data = std::move(data);
      Landing landing;
      landing.data = m->data.get();
      landing.capacity = env.nbytes;
      landing.done = [this, m](std::exception_ptr error) {
        std::shared_ptr<RecvRequest> claimant;
        {
          std::lock_guard<std::mutex> lock(mu_);
          m->complete = true;
          m->error = error;
          claimant = m->claimedBy;
        }
        if (claimant) deliver(*m, *claimant);
      };
      return landing;
    }
  }
  return landingFor(r, peer, env);
}

std::shared_ptr<Mailbox::Unexpected> Mailbox::queueUnexpectedLocked(int peer, const Envelope& env) {
  auto m = std::make_shared<Unexpected>();
  m->peer = peer;
  m->envelope = env;
  m->order = nextOrder_++;
  unexpected_[{peer, env.tag}].push_back(m);
  return m;
}

void Mailbox::arriveWhenPosted(int peer, const Envelope& env, std::function<void(Landing)> ready) {
  checkEnvelope(peer, env);
  if (isControlTag(env.tag)) {
    ready(arrive(peer, env));
    return;
  }
  std::shared_ptr<RecvRequest> r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    r = takePosted(peer, env);
    if (!r) {
      queueUnexpectedLocked(peer, env)->deferred = std::move(ready);
      return;
    }
  }
  ready(landingFor(r, peer, env));
}

void Mailbox::peerFailed(int peer, const std::string& cause) {
  if (onPeerFailed_) onPeerFailed_(peer, cause);
}

std::string Mailbox::abortNotice(int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = abortNotices_.find(peer);
  return it == abortNotices_.end() ? std::string() : it->second;
}

std::string Mailbox::closedCause(int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = closedPeers_.find(peer);
  return it == closedPeers_.end() ? std::string() : it->second;
}

void Mailbox::peerClosed(int peer, const std::string& cause) {
  std::vector<std::shared_ptr<RecvRequest>> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closedPeers_[peer] = cause;
    // Everything the peer sent has arrived: receives still waiting on it never complete.
    for (auto it = posted_.begin(); it != posted_.end();) {
      if (it->first.first == peer) {
        for (auto& r : it->second) victims.push_back(r);
        it = posted_.erase(it);
      } else {
        ++it;
      }
    }
  }
  auto err = std::make_exception_ptr(TransportError(peer, cause));
  for (auto& r : victims) r->completion->complete(err, peer);
}

void Mailbox::failAll(const std::exception_ptr& error) {
  std::vector<std::shared_ptr<RecvRequest>> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed_ = error ? error : std::make_exception_ptr(std::runtime_error("dicomm: communicator is closed"));
    for (auto& kv : posted_)
      for (auto& r : kv.second) victims.push_back(r);
    for (auto& kv : postedAny_)
      for (auto& r : kv.second) victims.push_back(r);
    for (auto& kv : unexpected_)
      for (auto& m : kv.second)
        if (m->claimedBy) victims.push_back(m->claimedBy);
    posted_.clear();
    postedAny_.clear();
    unexpected_.clear();
  }
  for (auto& r : victims) r->completion->complete(error, r->peer);
}

}  // namespace dicomm
