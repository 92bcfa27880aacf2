// Channel and server settings shared by every daemon: keepalive so a frozen peer is noticed in
// about a second and a half, and message size limits.
#pragma once

#include <memory>
#include <string>

#include "common/auth.h"
#include "grpcpp/channel.h"
#include "grpcpp/server_builder.h"

namespace lockstep {

// Largest message any Lockstep RPC accepts (job specs and reports are small).
inline constexpr int kMaxMessageBytes = 16 << 20;

// A channel to `target` with keepalive pings every 500 ms. Every call on it carries `auth`.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, const ClientAuth& auth = {});

// Server settings that permit the clients' keepalive pings and cap message sizes.
void ConfigureServer(grpc::ServerBuilder& builder);

}  // namespace lockstep
