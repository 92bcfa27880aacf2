// Channel and server settings shared by every daemon: keepalive so a frozen peer is noticed in
// about a second and a half, message size limits, and a named error for requests that do not
// parse.
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

// A request that does not parse (a string field holding bytes that are not UTF-8, a truncated
// message) is answered by gRPC itself with INTERNAL and no message; this interceptor makes that
// INVALID_ARGUMENT naming the method and the likely cause. Install it first, so that the
// interceptors after it see the code the client gets.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MalformedRequestInterceptorFactory();

}  // namespace lockstep
